"""LoRA-Land's public Python API."""

from app.catalog.sources import AdapterHub
from app.replica.engine import Delta
from app.replica.kernel import Completion, LLMKernel
from app.replica.sampling import SamplingParams

__all__ = ["LLMKernel", "AdapterHub", "Completion", "Delta", "SamplingParams"]
