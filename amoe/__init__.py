"""amoe: serving Mixture-of-Experts models with asynchronous expert parallelism."""

# torch first: amoe._core links against libc10 and needs it loaded.
import torch  # noqa: F401

__version__ = "0.1.0"
