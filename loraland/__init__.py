"""LoRA-Land's public Python API."""

from app.replica.engine import Delta
from app.replica.kernel import Completion, LLMKernel
from app.replica.sampling import SamplingParams

__all__ = ["LLMKernel", "Completion", "Delta", "SamplingParams"]
