"""LoRA-Land's public Python API."""

from app.catalog.sources import AdapterHub
from app.config.kernel_config import KernelConfig
from app.replica.kernel import LLMKernel
from app.replica.output_state import Delta
from app.replica.results import Completion, KernelStats
from app.sampling_params import SamplingParams

__all__ = ["LLMKernel", "KernelConfig", "AdapterHub", "Completion", "Delta", "KernelStats", "SamplingParams"]
