"""Who is admitted next when several tenants wait: first come first served, or the Virtual Token Counter.

VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024, Algorithm 2): every tenant has a
counter of the weighted service it received, `w_prompt * prompt tokens + w_output * output tokens`, divided by
the tenant's weight (the paper's weighted VTC). Admission takes the earliest waiting request of the backlogged
tenant with the smallest counter; within a tenant it is first come first served. The paper's bound: for two
tenants that stay backlogged over any interval, their service differs by at most 2 * max(w_prompt * L_input,
w_output * M) (L_input the longest prompt, M the most tokens a running batch holds), divided by the smaller
weight when weights differ.

Where the paper leaves a choice open, or this engine differs from its setting:
- Prompt tokens are charged at admission, the whole prompt at once, as the paper does (its prefill is one
  step): with chunked prefill the prompt is then computed over several steps, already paid for. A prefix-cache
  hit is charged in full too: the tenant is served the prompt either way.
- Output tokens are charged as they are sampled, one per sampled token, as the paper's per-step update does.
- Preemption (by recompute) charges nothing again: the prompt is charged once per request, and recomputing
  already sampled tokens samples nothing. A preempted request re-entering the queue is not an arrival, so no
  counter lift either.
- Counter lift, the paper's rule: when a request arrives from a tenant with no waiting request, its counter
  rises to the smallest counter among the tenants that are waiting; when nobody waits, to the counter of the
  last tenant that left the waiting queue. An idle tenant so banks no credit to come back and monopolize.
- A request whose adapter is not resident (the scheduler's `admit` hook refuses it) is skipped, and its tenant's
  next request is tried: a cold adapter blocks neither its tenant nor anyone else.
- Tenant None (no tenant: auth off, or the admin) is one tenant, "anonymous", of weight 1 unless set.

Beyond the paper, optional (`preempt=True`, KernelConfig.vtc_preempt): fair claims. The paper's VTC never
preempts, so a tenant that falls behind waits for a running request to finish before it gets a slot, which under a
flood of long requests is most of a request's length; and its prefill then rides in a step full of the flooder's
tokens. With `preempt`, every active tenant (waiting or running) is guaranteed floor(max_batch_size * its weight /
the active tenants' total weight) batch slots. A waiting request whose tenant runs fewer than its guarantee, and
whose counter is not above theirs, claims a slot from the tenants that run more than their guarantee (the
"yielders"), before any other admission:
- slot and KV: if the batch is full, or the KV cache lacks blocks for its first chunk, the yielders' running
  sequences give way, the most-served tenant's least computed first, never so many that a yielder falls below its
  own guarantee: held (the scheduler keeps them and their KV, unscheduled until a slot frees: no recompute) when
  the KV cache has room, preempted by recompute when their blocks are needed; if that cannot make room, it waits;
- budget: its first prefill chunk is scheduled first, before any running sequence, in the step's token budget;
- isolation (`isolate`, off by default): the step that carries that first chunk carries no token of the yielders
  (their running sequences sit out one step, keeping their KV; none of them is admitted in it), so that step is
  the claimant's prefill alone. Off, because measured it buys nothing and costs throughput: a step is not additive
  in its tokens when the weights are streamed once per step (memory-bound decode), so the yielders' decode tokens
  ride in the claimant's prefill step almost free, and sitting them out costs one whole step per claim (on 2 CPU
  cores, load_tests/fairness.md: flood throughput 0.83-1.00 of saturated with it, 0.98-1.14 without, B's TTFT
  p99 no better).
A slot so moves only from a tenant above its guarantee to one below it, never back while both stay on their side:
no thrashing. The counter condition keeps claims in VTC's direction (a claimant is never ahead of whom it takes
from), so the bound still holds, and a yielder is never starved: a claim charges the claimant's prompt, and once
its counter passes the yielder's it claims no more.
Tried and removed: a prefill cap (while a light tenant is active, the others' prefill tokens per step capped, so
that no step its request can land behind carries several of their prompts). It shortened the long steps (the
flood's step p99 -15%) but the light tenant's TTFT p99 did not follow (load_tests/fairness.md; the code is in git
history, commit 18c0f99): what remains is the rest of an ordinary step in flight and the flooder's decodes riding
in the light request's first step.
Tried and removed too: a light prefill budget (KernelConfig.vtc_light_prefill; commit 07fae23): while a light
tenant is active, a step carries at most N prefill tokens, the light tenant's first and never cut, the others' in
what is left (decodes untouched), so the step its request lands behind is short and its own first step carries none
of the flooder's prompts. With N=32 the wait for the step in flight fell (p99 0.028-0.029 s against 0.037-0.046 s)
but the light tenant's own first step did not (p99 0.043-0.044 s, 0.042-0.045 s without), and its TTFT p99 under the flood
followed in one pass of two (0.061 and 0.066 s against 0.066-0.075 s), at a throughput cost (0.98-1.02 of
saturated against 1.00-1.16); N=16 no better and 0.93 (load_tests/fairness.md, "The light prefill budget").
Decode rows were left uncapped on measurement: a decode row costs ~1 ms against a step's ~12 ms fixed cost here.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from app.config.kernel_config import SCHEDULING_POLICIES
from app.replica.sequence import Sequence

# The paper's linear cost: an output token costs twice a prompt token (its experiments use w_p=1, w_q=2).
W_PROMPT = 1.0
W_OUTPUT = 2.0

_NOBODY = object()  # "no tenant has left the queue yet" (None is a tenant: the anonymous one)


@dataclass(frozen=True)
class Claim:
    """A waiting sequence is owed a slot now. victims: running sequences the scheduler may preempt to make room
    (slot or KV blocks), in the order to take them (none: only a free slot will do); yielders: tenants whose running
    sequences sit out the step that carries the claimant's first prefill chunk."""

    victims: tuple[Sequence, ...] = ()
    yielders: frozenset[str | None] = frozenset()


class AdmissionPolicy(Protocol):
    """What the scheduler asks of a policy; every call is on the engine thread, except `set_weights`.

    enqueued: seq joined the waiting queue (arrival False: it was preempted); dequeued: it left the queue
    (admitted, aborted, failed); order: the waiting sequences in admission order, re-read after each admission;
    admitted: a candidate was admitted; sampled: one output token was sampled for seq; claims: whether `claim`
    can ever answer; claim: whether waiting seq is owed a slot now, ahead of the order, and at whose expense (None:
    no); kv_victim: which of the running sequences not yet scheduled this step to preempt when KV blocks run out
    (they are in admission order)."""

    claims: bool

    def enqueued(self, seq: Sequence, arrival: bool) -> None: ...
    def dequeued(self, seq: Sequence) -> None: ...
    def order(self, waiting: list[Sequence]) -> Iterator[Sequence]: ...
    def admitted(self, seq: Sequence) -> None: ...
    def sampled(self, seq: Sequence) -> None: ...
    def set_weights(self, weights: Mapping[str | None, float]) -> None: ...
    def claim(self, seq: Sequence, running: list[Sequence], max_batch: int) -> Claim | None: ...
    def kv_victim(self, candidates: list[Sequence]) -> Sequence: ...


class FirstComeFirstServed:
    """Arrival order, tenants ignored (the scheduler's behaviour before fairness)."""

    claims = False

    def enqueued(self, seq: Sequence, arrival: bool) -> None:
        pass

    def dequeued(self, seq: Sequence) -> None:
        pass

    def order(self, waiting: list[Sequence]) -> Iterator[Sequence]:
        return iter(list(waiting))

    def admitted(self, seq: Sequence) -> None:
        pass

    def sampled(self, seq: Sequence) -> None:
        pass

    def set_weights(self, weights: Mapping[str | None, float]) -> None:
        pass

    def claim(self, seq: Sequence, running: list[Sequence], max_batch: int) -> Claim | None:
        return None

    def kv_victim(self, candidates: list[Sequence]) -> Sequence:
        return candidates[-1]  # the newest


class VirtualTokenCounter:
    """Per-tenant counters of weighted service; see the module docstring for the rules."""

    def __init__(
        self,
        w_prompt: float = W_PROMPT,
        w_output: float = W_OUTPUT,
        weights: Mapping[str | None, float] | None = None,
        preempt: bool = False,
        isolate: bool = False,
    ):
        for name, w in (("w_prompt", w_prompt), ("w_output", w_output)):
            if not _positive(w):
                raise ValueError(f"VTC {name} must be a positive number, got {w!r}")
        self.w_prompt, self.w_output = float(w_prompt), float(w_output)
        self.preempt = preempt
        self.isolate = isolate  # only with preempt: a claim's first prefill step carries no yielder's token
        self.counters: dict[str | None, float] = {}
        self._weights: dict[str | None, float] = {}
        self._waiting: Counter[str | None] = Counter()  # tenant -> its requests in the waiting queue
        self._last_left: object = _NOBODY
        if weights:
            self.set_weights(weights)

    # ------------------------------------------------------------------ weights (any thread)
    def set_weights(self, weights: Mapping[str | None, float]) -> None:
        """Replace every tenant's weight (a tenant not named has weight 1). A tenant of weight 2 is served
        twice the tokens of a tenant of weight 1 while both wait. Counters keep their value."""
        checked = {}
        for tenant, w in weights.items():
            if not _positive(w):
                raise ValueError(f"tenant {tenant!r}: weight must be a positive number, got {w!r}")
            checked[tenant] = float(w)
        self._weights = checked  # one assignment: the engine thread sees the old or the new map, whole

    def weight(self, tenant: str | None) -> float:
        return self._weights.get(tenant, 1.0)

    def counter(self, tenant: str | None) -> float:
        return self.counters.get(tenant, 0.0)

    # ------------------------------------------------------------------ the waiting queue
    def enqueued(self, seq: Sequence, arrival: bool) -> None:
        t = seq.tenant
        if arrival and self._waiting[t] == 0:
            self._lift(t)
        self._waiting[t] += 1

    def _lift(self, tenant: str | None) -> None:
        others = [self.counter(u) for u, n in self._waiting.items() if n > 0 and u != tenant]
        if others:
            floor = min(others)
        elif self._last_left is not _NOBODY:
            floor = self.counter(self._last_left)  # type: ignore[arg-type]
        else:
            return
        self.counters[tenant] = max(self.counter(tenant), floor)

    def dequeued(self, seq: Sequence) -> None:
        t = seq.tenant
        self._waiting[t] -= 1
        if self._waiting[t] <= 0:
            del self._waiting[t]
            self._last_left = t

    def order(self, waiting: list[Sequence]) -> Iterator[Sequence]:
        """The head of the smallest-counter tenant, again and again; re-read after every yield, so a charge
        made by `admitted` moves the next pick. Ties go to the tenant whose head arrived first."""
        queues: dict[str | None, deque[Sequence]] = {}
        for seq in waiting:  # `waiting` is in arrival order, so each deque is too
            queues.setdefault(seq.tenant, deque()).append(seq)
        while queues:
            t = min(queues, key=lambda u: (self.counter(u), queues[u][0].arrival))
            q = queues[t]
            seq = q.popleft()
            if not q:
                del queues[t]
            yield seq

    # ------------------------------------------------------------------ fair claims (preempt=True)
    @property
    def claims(self) -> bool:
        return self.preempt

    def guarantees(self, tenants: set[str | None], max_batch: int) -> dict[str | None, int]:
        """Batch slots each active tenant is guaranteed: its weighted share, rounded down."""
        total = sum(self.weight(t) for t in tenants)
        return {t: math.floor(max_batch * self.weight(t) / total + 1e-9) for t in tenants}

    def claim(self, seq: Sequence, running: list[Sequence], max_batch: int) -> Claim | None:
        """Whether waiting `seq` is owed a slot now (see the module docstring), and at whose expense. `running`:
        the sequences holding batch slots (held ones do not). Only against a tenant above its guarantee: with one
        tenant, or nobody above, admission stays the ordinary one (head of line keeps its place)."""
        if not self.preempt:
            return None
        count = Counter(r.tenant for r in running)
        g = self.guarantees(set(self._waiting) | set(count) | {seq.tenant}, max_batch)
        t = seq.tenant
        if count[t] >= g[t]:
            return None
        mine = self.counter(t)
        over = [u for u in count if u != t and count[u] > g[u] and self.counter(u) >= mine]
        if not over:
            return None  # nobody above its guarantee: no contention, ordinary admission is fair enough
        victims: list[Sequence] = []
        for u in sorted(over, key=lambda u: -self.counter(u)):  # the most served gives first
            theirs = sorted((r for r in running if r.tenant == u), key=lambda r: (r.num_computed, -r.arrival))
            victims += theirs[: count[u] - g[u]]
        return Claim(tuple(victims), frozenset(over) if self.isolate else frozenset())

    def kv_victim(self, candidates: list[Sequence]) -> Sequence:
        """Out of KV blocks: without preempt, the newest (the scheduler's rule); with it, the newest of the most
        served tenant among the candidates, so a tenant behind does not pay for the flooder's growth."""
        if not self.preempt:
            return candidates[-1]
        top = max(self.counter(c.tenant) for c in candidates)
        return [c for c in candidates if self.counter(c.tenant) == top][-1]

    # ------------------------------------------------------------------ charging
    def admitted(self, seq: Sequence) -> None:
        if seq.prompt_charged:  # re-admitted after preemption: its prompt was paid for
            return
        seq.prompt_charged = True
        self._charge(seq.tenant, self.w_prompt * len(seq.prompt_ids))

    def sampled(self, seq: Sequence) -> None:
        self._charge(seq.tenant, self.w_output)

    def _charge(self, tenant: str | None, cost: float) -> None:
        self.counters[tenant] = self.counter(tenant) + cost / self.weight(tenant)


def make_policy(
    name: str,
    w_prompt: float = W_PROMPT,
    w_output: float = W_OUTPUT,
    preempt: bool = False,
    isolate: bool = False,
) -> FirstComeFirstServed | VirtualTokenCounter:
    if name == "vtc":
        return VirtualTokenCounter(w_prompt, w_output, preempt=preempt, isolate=isolate)
    if name == "fcfs":
        return FirstComeFirstServed()
    raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {name!r}")


def _positive(w: object) -> bool:
    return not isinstance(w, bool) and isinstance(w, (int, float)) and math.isfinite(w) and w > 0
