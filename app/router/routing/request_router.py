"""Adapter-affinity routing for the replica deployment: a Ray Serve `RequestRouter`.

A request's adapters are read from the ReplicaRequest itself (its `spec`, parsed and resolved once by the
ingress). Replicas report what they hold through `record_routing_stats()` (a ReplicaStats); those stats reach the router only every
`request_routing_stats_period_s`, so the router also remembers where it just sent each adapter: a burst
of requests for a cold adapter then lands on the one replica that is already loading it instead of
making every replica fetch it. That memory also says which adapters are warm (routed within it): placement.py
bounds their holders' load by the cluster's mean, and keeps other adapters on their holders until full.

Ray picks within a tier by its queue-length cache: when any candidate is cached it takes the lowest cached one
and only probes the others in the background, with a 0.1 s deadline that a busy 2-core machine often misses. So
an idle replica that has not been sent anything for the cache's 10 s stays uncached and is never chosen while a
busy one has room (a clean-clone CI run saw six long streams in a row go to one replica beside an idle one).
The router therefore fills a missing cache entry from the replica's own recent stats (its count of requests in
progress), which Ray then compares like any probe result. Stats older than STATS_FRESH_S say nothing about load
(a burst seconds ago would keep an idle replica "full"): its load is then the router's own count of requests
in flight. That count can stay high when Ray misses a request's end; fresh stats taken after this router's
last send there lower it to the replica's own count of generate() calls in progress.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from app.protocol import ReplicaRequest, ReplicaStats
from app.router.routing.assignments import AssignmentMemory
from app.router.routing.decisions import record_decision
from app.router.routing.placement import PlacementPolicy, ReplicaView, rank_replicas, view_from_stats

logger = logging.getLogger("ray.serve")

# How long a "just sent there" memory counts without the replica's stats confirming it.
ASSIGNMENT_TTL_S = 30.0
# A replica's stats at most this old count as its load, and stand in for a missing queue-length cache entry
# (stats come every routing_stats_period_s, 1 s by default, through the controller's long poll, which lags on a
# busy machine). Older ones still say which adapters it holds.
STATS_FRESH_S = 3.0
# After Ray reports a replica unavailable, it is left to Ray's own probes for this long (no stats seeding).
UNAVAILABLE_HOLD_S = 10.0


def stats_of(replica: RunningReplica) -> ReplicaStats | None:
    """A replica's last routing stats (None until its first report arrives)."""
    return ReplicaStats.of(getattr(replica, "routing_stats", None))


def adapters_needed(pending_request: PendingRequest | None) -> list[str]:
    """The adapter versions a request needs, from the ReplicaRequest the ingress parsed and resolved: 'a@1|b@2'
    and 'a@1*0.5+b@2*0.5' need both. Other calls (inspect_adapter, tokenize) need none."""
    args = pending_request.args if pending_request is not None else None
    request = args[0] if args else None
    return [t.ref for t in request.spec.terms()] if isinstance(request, ReplicaRequest) else []


class AdapterAffinityRouter(RequestRouter):
    """Ranks replicas with `placement.rank_replicas`; Serve probes each tier and takes the shortest queue."""

    def initialize_state(
        self,
        overload_load: float = 1.0,
        overload_kv: float = 0.95,
        max_per_tier: int = 4,
        assignment_ttl_s: float = ASSIGNMENT_TTL_S,
        balance: float | None = 1.2,
        **_ignored,
    ) -> None:
        self._policy = PlacementPolicy(overload_load, overload_kv, max_per_tier, balance)
        self._memory = AssignmentMemory(assignment_ttl_s)  # adapter ref -> replica unique ids, recent first
        self._swept = time.time()
        # Per replica: the view built from its last stats object and in-flight count. Stats change once a stats
        # period, most replicas' counts not at all between two requests; building every view per request cost
        # ~30 ms at 1,000 replicas (tests/test_request_router.py).
        self._views: dict[str, tuple[object, int, bool, ReplicaView]] = {}
        self._unavailable_at: dict[str, float] = {}  # replica unique id -> when Ray last found it unavailable
        self._last_sent: dict[str, float] = {}  # replica unique id -> when this router last sent it a request

    def _state_ready(self) -> None:
        # initialize_state is only called when request_router_kwargs are given; be safe either way.
        if not hasattr(self, "_policy"):
            self.initialize_state()

    def _queue_len(self, r: RunningReplica, now: float) -> int:
        """Requests in flight at `r`: Ray's cached count, else (filling the cache) the count in its fresh stats."""
        cache = self.replica_queue_len_cache
        known = cache.get(r.replica_id)
        stats = stats_of(r)
        uid = r.replica_id.unique_id
        if stats is None or not stats.fresh(now, STATS_FRESH_S):
            return 0 if known is None else known  # no recent stats: Ray's count, or Ray probes it
        theirs = stats.ongoing  # the replica's own count of generate() calls in progress
        if known is not None:
            # Ray's count can stay high (request ends it did not see: an e2e run had an idle replica stuck at 10
            # and six streams in a row sent to the other). The replica's own count, taken after this router's
            # last send there, is the truth then.
            if theirs < known and stats.at > self._last_sent.get(uid, 0.0):
                cache.update(r.replica_id, theirs)
                return theirs
            return known
        if now - self._unavailable_at.get(uid, now - UNAVAILABLE_HOLD_S) < UNAVAILABLE_HOLD_S:
            return 0  # Ray found it unavailable lately: leave it to Ray's probes
        cache.update(r.replica_id, theirs)
        return theirs

    def _recent_placement(self, adapters: list[str]) -> dict[str, list[str]]:
        """Where this router sent each of `adapters` within its memory, live replicas only (the warm ones)."""
        now = time.time()
        if now - self._swept >= self._memory.ttl_s:  # forget adapters no request looked up since they expired
            self._memory.sweep(now)
            self._swept = now
        stats = {
            r.replica_id.unique_id: stats_of(r) or ReplicaStats(r.replica_id.unique_id)
            for r in self._replicas.values()
        }
        out: dict[str, list[str]] = {}
        for adapter in adapters:
            where = self._memory.confirmed(adapter, now, stats.get)
            if where:
                out[adapter] = where
        return out

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        self._state_ready()
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # The tiers below cover every replica: when none of them takes the request, Ray must sleep before
            # the next pass (the flag's default, False, makes it retry at once, again and again).
            pending_request.routing_context.should_backoff = True
        by_uid = {r.replica_id.unique_id: r for r in candidate_replicas}
        if len(self._views) > 2 * len(by_uid) + 8:  # replicas gone without a death notice (scaled down)
            self._views = {uid: v for uid, v in self._views.items() if uid in by_uid}
            self._unavailable_at = {u: t for u, t in self._unavailable_at.items() if u in by_uid}
            self._last_sent = {u: t for u, t in self._last_sent.items() if u in by_uid}
        views = []
        now = time.time()
        for r in candidate_replicas:
            uid, stats = r.replica_id.unique_id, stats_of(r)
            # The router's own count of requests in flight is fresher than the replica's last stats.
            ongoing = self._queue_len(r, now)
            fresh = stats is not None and stats.fresh(now, STATS_FRESH_S)
            cached = self._views.get(uid)
            if cached is None or cached[0] is not stats or cached[2] != fresh:
                # Old stats still say what the replica holds, not how loaded it is.
                view = view_from_stats(
                    uid, stats, ongoing=ongoing, max_ongoing=r.max_ongoing_requests, with_load=fresh
                )
                self._views[uid] = (stats, ongoing, fresh, view)
            elif cached[1] != ongoing or cached[3].max_ongoing != r.max_ongoing_requests:
                view = dataclasses.replace(cached[3], ongoing=ongoing, max_ongoing=r.max_ongoing_requests)
                self._views[uid] = (stats, ongoing, fresh, view)
            else:
                view = cached[3]
            views.append(view)
        needed = adapters_needed(pending_request)
        recent = self._recent_placement(needed)
        tiers = rank_replicas(needed, views, recent, self._policy, warm=recent.keys())
        return [[by_uid[rid] for rid in tier] for tier in tiers]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._state_ready()
        replica = self._replicas.get(replica_id)
        needed = adapters_needed(pending_request)
        # Classified on what this router knew before this request (its own memory is updated below).
        if pending_request.metadata.call_method == "generate":  # not admin calls (inspect_adapter)
            stats = stats_of(replica) if replica is not None else None
            record_decision(needed, stats, self._recent_placement(needed), replica_id.unique_id)
        now = time.time()
        self._last_sent[replica_id.unique_id] = now
        for adapter in needed:
            self._memory.record(adapter, replica_id.unique_id, now)

    def on_replica_actor_unavailable(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_unavailable(replica_id)
        self._state_ready()
        self._unavailable_at[replica_id.unique_id] = time.time()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._state_ready()
        self._memory.forget_replica(replica_id.unique_id)
        self._views.pop(replica_id.unique_id, None)
        self._unavailable_at.pop(replica_id.unique_id, None)
        self._last_sent.pop(replica_id.unique_id, None)
