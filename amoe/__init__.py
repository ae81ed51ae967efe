"""amoe: serving Mixture-of-Experts models with asynchronous expert parallelism."""

# torch first: amoe._core links against libc10 and needs it loaded.
import torch  # noqa: F401

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # Lazy: `import amoe` stays cheap for processes (coordinator, C++ tests) that never build an engine.
    if name == "LLM":
        from amoe.llm import LLM

        return LLM
    if name == "SamplingParams":
        from amoe.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'amoe' has no attribute {name!r}")
