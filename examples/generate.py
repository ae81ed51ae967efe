"""Offline generation in one process. Without a model path, amoe serves its shipped default model (kjv-moe)."""

from amoe import LLM, SamplingParams

llm = LLM(model=None)  # or a Hugging Face Mixtral directory, e.g. one written by `amoe make-model`
params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=0)
for result in llm.generate(["The lighthouse keeper", "Once upon a time"], params):
    print(f"{result.prompt!r} -> {result.outputs[0].text!r}")
