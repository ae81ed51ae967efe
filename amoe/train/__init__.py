"""Training the default model: a small Mixtral trained on CPU from a fixed seed, the checkpoint `amoe serve` serves
without --model. Apparatus, not product: nothing that serves requests imports this package."""
