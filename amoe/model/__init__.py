"""The model: config, checkpoint loading, and the layers a runtime executes (attention, experts, head, sampler)."""
