"""LLMKernel's options and their defaults: the one place they live (the kernel, AppConfig's `kernel:` section,
`loraland serve` and the engine read them from here). No torch import: the ingress validates these too."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# What `dtype` may be; app/replica/models/dtypes.py's resolve_dtype maps each to a torch dtype ("auto": the model's
# dtype on CUDA, bf16 on CPUs with fast bf16, else fp32).
DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
# Admission between tenants (app/replica/fairness.py): "vtc", the Virtual Token Counter (fair shares of weighted
# tokens; per-tenant weights from the catalog via LLMKernel.set_tenant_weights), or "fcfs", arrival order.
SCHEDULING_POLICIES = ("vtc", "fcfs")


@dataclass(frozen=True)
class KernelConfig:
    """One replica's kernel: adapter tiers, batching, memory. Validated here, before any model is loaded."""

    max_adapters: int = 64  # device slots (adapters in one batch's pools)
    max_cpu_adapters: int | None = None  # host cache of parsed adapters; None: max(2 * max_adapters, 64)
    max_batch_size: int = 32  # running sequences per step
    gpu_memory_utilization: float = 0.9  # share of free device (or host) memory for weights + KV cache
    max_lora_rank: int = 64  # adapters (and merges' terms) above this rank are refused at load
    # Full per-adapter copies of embed_tokens/lm_head (PEFT modules_to_save, or a saved base weight that differs
    # from the served one): the most bytes one adapter may hold, at the served dtype (1 GiB: an lm_head of a
    # 128k-vocabulary, 4096-wide model in bf16); above it the adapter is refused. 0 refuses every copy; None: no
    # limit.
    max_saved_module_bytes: int | None = 1 << 30
    dtype: str = "auto"  # one of DTYPES
    device: str = "auto"  # "auto" (cuda when available, else cpu), or a torch device string
    max_model_len: int | None = None  # prompt + output tokens; None: the model's max_position_embeddings
    block_size: int = 16  # tokens per KV-cache block
    num_kv_blocks: int | None = None  # None: as many as gpu_memory_utilization leaves room for
    # Token budget of one engine step. 4096 over 2048: +25% output tok/s over HTTP on workload W (2 CPU
    # cores), prefill in fewer, larger GEMMs.
    max_num_batched_tokens: int = 4096
    enable_prefix_caching: bool = True
    max_waiting: int = 4096  # queued sequences before QueueFull (HTTP 429)
    scheduling_policy: str = "vtc"  # one of SCHEDULING_POLICIES
    # VTC's cost of a token (the paper's w_p, w_q): an output token costs twice a prompt token, as decoding one
    # costs far more time than prefilling one.
    vtc_prompt_weight: float = 1.0
    vtc_output_weight: float = 2.0
    # Beyond the paper, fair claims (app/replica/fairness.py): each active tenant is guaranteed its weighted share
    # of batch slots; a request of a tenant below its share (and not ahead in service) is admitted at once, first
    # in the step's budget, holding (KV kept) or preempting (recompute, when KV is short) sequences of tenants above
    # their share when the batch or the KV cache is full. Its TTFT no longer waits for a flooder's requests to
    # finish. On by default: with one tenant, or nobody above its share, admission is the paper's; under a flood
    # the light tenant's TTFT p99 is 1.0-1.8x its TTFT alone in-process and 1.9-2.4x over HTTP on 2 cores (the
    # paper's VTC: 3.4-6.3x; FCFS 37-54x) at the same throughput (load_tests/fairness.md). Only with
    # scheduling_policy "vtc".
    vtc_preempt: bool = True
    # Replaces the tokenizer's chat template: a file path, or the Jinja template itself (anything holding "{{" or
    # "{%"). None: the model's own (its tokenizer's chat_template / chat_template.jinja).
    chat_template: str | None = None

    def __post_init__(self) -> None:
        t = self.chat_template
        if t is not None and (not isinstance(t, str) or not t.strip()):
            raise ValueError(f"chat_template must be a file path or a Jinja template string, got {t!r}")
        if not isinstance(self.dtype, str):  # a torch.dtype, as LLMKernel always accepted: keep its name
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        required = ("max_adapters", "max_batch_size", "max_lora_rank", "block_size", "max_num_batched_tokens")
        for name in (*required, "max_waiting"):
            _positive_int(name, getattr(self, name))
        for name in ("max_cpu_adapters", "max_model_len", "num_kv_blocks"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name), "or None")
        m = self.max_saved_module_bytes
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise ValueError(f"max_saved_module_bytes must be a number of bytes >= 0 or None, got {m!r}")
        g = self.gpu_memory_utilization
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {g!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported: use one of {', '.join(DTYPES)}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(
                f"device must be 'auto' or a torch device string such as 'cpu', got {self.device!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        for name in ("vtc_prompt_weight", "vtc_output_weight"):
            w = getattr(self, name)
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w < float("inf"):
                raise ValueError(f"{name} must be a positive number, got {w!r}")
        if not isinstance(self.vtc_preempt, bool):
            raise ValueError(f"vtc_preempt must be true or false, got {self.vtc_preempt!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}"
            )

    @classmethod
    def option_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> KernelConfig:
        """From keyword options (LLMKernel's **options, AppConfig's `kernel:`); an unknown key is a TypeError, as
        an unknown keyword argument is, and a bad value a ValueError."""
        unknown = sorted(set(options) - cls.option_names())
        if unknown:
            raise TypeError(f"unknown keys {unknown}; LLMKernel accepts {sorted(cls.option_names())}")
        return cls(**options)


def _positive_int(name: str, value: Any, also: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1{' ' + also if also else ''}, got {value!r}")
