"""amoe: serving Mixture-of-Experts models with asynchronous expert parallelism.

`import amoe` stays light (no torch): the coordinator and the CLI's help never load a model. Torch comes with
amoe.core (the C++ extension) and amoe.model.
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # Lazy: `from amoe import LLM` builds the engine's imports only when asked for.
    if name == "LLM":
        from amoe.llm import LLM

        return LLM
    if name == "SamplingParams":
        from amoe.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'amoe' has no attribute {name!r}")
