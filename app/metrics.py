"""This process's Prometheus metrics (every name starts with `loraland_`), their bounded labels, and snapshots.

One scrape story for a cluster: every LoRA-Land process records into its own registry here; replicas and ingress
replicas put a snapshot of it in the catalog every `publish_s` seconds (app/catalog/telemetry.py), and any
ingress answers GET /metrics with its own registry read live plus every other process's latest snapshot, each
series labelled with the process it came from (`replica="..."` or `ingress="..."`; app/router/http/metrics.py). So
one scrape target (the HTTP address, on any node) covers every node, and nothing needs a port per process.

Label cardinality is bounded: adapter and tenant values pass through a `TopK` (the busiest by recent traffic
keep their names, the rest are "(other)"); the other labels take a handful of fixed values.

Any layer may record here (the engine's adapter manager, the catalog's error counter); this module imports
nothing from app/ but the config, so it sits below them all.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict, deque
from typing import Any

from app import metrics_core as mc
from app.config.metrics_config import MetricsConfig

OTHER = "(other)"  # adapters or tenants beyond the top K
BASE = "(base)"  # a request for the base model, no adapter
NONE = "(none)"  # not known: a request refused before its adapter or tenant was resolved
# Parentheses cannot occur in adapter or tenant names (app/names.py), so these never collide with a real one.

PROCESS = uuid.uuid4().hex  # this process, in its snapshots: the ingress never merges its own twice
FAMILIES: list[mc._Family] = []  # recorded as things happen
# Read when a snapshot is taken: callables returning snapshot families (a replica's gauges from its kernel).
COLLECTORS: list = []
_config = MetricsConfig()
_identity: dict[str, str] = {}  # labels naming this process in the cluster view, e.g. {"replica": "abc"}


class TopK:
    """Bounded label values: the K values with the most recent traffic keep their names, the rest map to OTHER.

    Counts are kept for at most `capacity` values (space-saving: a new value replaces the least counted
    unlabelled one and inherits its count) and halved every few thousand calls, so "traffic" means recent
    traffic. A value that has its own label keeps it until another one has more than twice its count; when it
    loses it, `on_demote(value)` drops its series, so the number of series stays bounded as adapters come and
    go."""

    def __init__(self, k: int, capacity: int | None = None, on_demote=None):
        self.k = k
        self.capacity = max(capacity or 8 * k, k + 1)
        self.counts: dict[str, float] = {}
        self.labelled: set[str] = set()
        self.on_demote = on_demote or (lambda value: None)
        self._calls = 0
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        demoted = None
        with self._lock:
            self._calls += 1
            if self._calls % (16 * self.capacity) == 0:
                self.counts = {v: c / 2 for v, c in self.counts.items()}
            count = self.counts.get(value)
            if count is None:
                count = 0.0
                if len(self.counts) >= self.capacity:
                    free = [v for v in self.counts if v not in self.labelled]
                    victim = min(free, key=self.counts.__getitem__)
                    count = self.counts.pop(victim)
            self.counts[value] = count = count + 1
            if value in self.labelled:
                return value
            if len(self.labelled) < self.k:
                self.labelled.add(value)
                return value
            weakest = min(self.labelled, key=self.counts.__getitem__)
            if count <= 2 * self.counts[weakest]:
                return OTHER
            self.labelled.discard(weakest)
            self.labelled.add(value)
            demoted = weakest
        self.on_demote(demoted)
        return value


def _h(name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> mc._Family:
    FAMILIES.append(mc.histogram(name, doc, labels, buckets))
    return FAMILIES[-1]


def _c(name: str, doc: str, labels: tuple[str, ...] = ()) -> mc._Family:
    FAMILIES.append(mc.counter(name, doc, labels))
    return FAMILIES[-1]


# ---------------------------------------------------------------- the ingress: one request's outcome and timing
REQUESTS = _c(
    "loraland_requests", "Requests by outcome (HTTP status class)", ("adapter", "tenant", "outcome")
)
PROMPT_TOKENS = _c("loraland_prompt_tokens", "Prompt tokens of answered requests", ("adapter", "tenant"))
COMPLETION_TOKENS = _c("loraland_completion_tokens", "Generated tokens", ("adapter", "tenant"))
TTFT = _h(
    "loraland_time_to_first_token_seconds",
    "From the request's arrival at the ingress to its first generated token",
    ("adapter",),
    (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
TPOT = _h(
    "loraland_time_per_output_token_seconds",
    "Mean time between generated tokens after the first (per request)",
    ("adapter",),
    (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
E2E = _h(
    "loraland_request_duration_seconds",
    "From the request's arrival at the ingress to its last byte",
    ("adapter",),
    (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
ROUTER_DECISIONS = _c(
    "loraland_router_decisions",
    "Where the adapter-affinity router sent requests: to a replica holding the adapters (held), one with a "
    "free slot for them (free_slot), any other (any), or base-model requests (base)",
    ("decision",),
)
REPLICA_RETRIES = _c(
    "loraland_replica_retries",
    "Requests whose replica died before they produced output: sent again to another replica (retried), or "
    "failed with a retryable error once every attempt was spent (gave_up)",
    ("outcome",),
)
# ---------------------------------------------------------------- replicas: adapter tiers (gauges: app/replica/metrics.py)
ADAPTER_LOADS = _c(
    "loraland_adapter_loads",
    "Adapter versions fetched, validated and registered on a replica, by where the files came from",
    ("adapter", "source"),
)
ADAPTER_LOAD_SECONDS = _h(
    "loraland_adapter_load_seconds",
    "Adapter load latency (fetch, validate, register) by source",
    ("source",),
    (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
ADAPTER_LOAD_BYTES = _c("loraland_adapter_load_bytes", "Adapter bytes loaded, by source", ("source",))
ADAPTER_LOAD_FAILURES = _c("loraland_adapter_load_failures", "Adapter loads that failed", ("adapter",))
ADAPTER_RELOADS = _c(
    "loraland_adapter_reloads",
    "Adapters read again from their source after the host cache had dropped them",
    ("adapter",),
)
EVICTIONS = _c(
    "loraland_adapter_evictions",
    "Adapters evicted from a tier (device: a slot reused; host: the host copy dropped)",
    ("adapter", "tier"),
)
# ---------------------------------------------------------------- the catalog
CATALOG_ERRORS = _c("loraland_catalog_errors", "Catalog (Redis) calls that failed to reach Redis", ("op",))

_ADAPTER_METRICS = (REQUESTS, PROMPT_TOKENS, COMPLETION_TOKENS, TTFT, TPOT, E2E, ADAPTER_LOADS)
_ADAPTER_METRICS += (ADAPTER_LOAD_FAILURES, ADAPTER_RELOADS, EVICTIONS)
_TENANT_METRICS = (REQUESTS, PROMPT_TOKENS, COMPLETION_TOKENS)


def _drop(metrics: tuple, label: str, value: str) -> None:
    """Remove every series whose `label` is `value` (a demoted adapter or tenant)."""
    for m in metrics:
        m.remove_where(label, value)


adapters = TopK(_config.top_adapters, on_demote=lambda v: _drop(_ADAPTER_METRICS, "adapter", v))
tenants = TopK(_config.top_tenants, on_demote=lambda v: _drop(_TENANT_METRICS, "tenant", v))


def configure(config: MetricsConfig) -> None:
    """Apply `config` to this process (once, at start; the top-K counts start over)."""
    global _config, adapters, tenants, _events
    _config = config
    adapters = TopK(config.top_adapters, on_demote=lambda v: _drop(_ADAPTER_METRICS, "adapter", v))
    tenants = TopK(config.top_tenants, on_demote=lambda v: _drop(_TENANT_METRICS, "tenant", v))
    _events = deque(_events, maxlen=2 * config.recent_events)


def config() -> MetricsConfig:
    return _config


def enabled() -> bool:
    return _config.enabled


def identify(**labels: str) -> None:
    """Name this process in the cluster view (`replica=` on a replica, `ingress=` on an ingress); first wins."""
    for k, v in labels.items():
        _identity.setdefault(k, v)


def identity() -> dict[str, str]:
    return dict(_identity)


def adapter_label(name: str | None) -> str:
    """`name` if it is among the busiest adapters, else OTHER (None is the base model)."""
    return BASE if name is None else adapters(name)


def tenant_label(name: str | None) -> str:
    return NONE if name is None else tenants(name)


def adapter_seen(name: str) -> str:
    """`name`'s label as it stands, without counting a use (for loads and evictions, which are not traffic)."""
    return name if name in adapters.labelled else OTHER


# ---------------------------------------------------------------- recent events and adapter use, for GET /status
_events: deque[dict] = deque(maxlen=2 * _config.recent_events)
_last_used: OrderedDict[str, float] = OrderedDict()
_side_lock = threading.Lock()


def event(kind: str, **fields: Any) -> None:
    """Remember a recent `kind` ("error" or "load") event for the status page (bounded; newest kept)."""
    if _config.enabled:
        with _side_lock:
            _events.append({"kind": kind, "time": time.time(), **fields})


def used(adapter: str) -> None:
    """When `adapter` (a name, or a chain/merge text) last served a request, for the status page (bounded)."""
    if not _config.enabled:
        return
    with _side_lock:
        _last_used[adapter] = time.time()
        _last_used.move_to_end(adapter)
        while len(_last_used) > 4 * _config.top_adapters:
            _last_used.popitem(last=False)


def snapshot() -> dict[str, Any]:
    """Everything this process reports, JSON-ready: its metric families (app/metrics_core.py's snapshot form),
    its identity labels, recent events and adapter use. What it publishes, and what the ingress reads live."""
    families = [f.snapshot() for f in FAMILIES]
    for collect in list(COLLECTORS):
        families.extend(collect())
    with _side_lock:
        events, last_used = list(_events), dict(_last_used)
    return {
        "process": PROCESS,
        # Every process's series must differ from every other's in the merged scrape: name it somehow.
        "labels": identity() or {"process": PROCESS[:12]},
        "time": time.time(),
        "families": families,
        "events": events,
        "last_used": last_used,
    }
