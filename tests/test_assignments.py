"""The router's memory of where it just sent each adapter (app/router/routing/assignments.py): what makes an adapter
warm for placement.py, shared by AdapterAffinityRouter and the placement simulator."""

import pytest

from app.protocol import ReplicaStats
from app.router.routing.assignments import AssignmentMemory


def test_assignments_expire_after_the_ttl_oldest_first():
    m = AssignmentMemory(ttl_s=10)
    m.record("a@1", "r1", now=0)
    m.record("a@1", "r2", now=5)
    assert m.where("a@1", now=9.9) == ["r1", "r2"]
    assert m.where("a@1", now=10) == ["r2"]  # r1's assignment is exactly ttl old: gone
    m.record("a@1", "r1", now=11)  # sent there again: newest now
    assert m.where("a@1", now=12) == ["r2", "r1"]
    assert m.where("a@1", now=21) == []
    assert len(m) == 0  # a lookup that empties an adapter forgets it
    assert m.where("never@1", now=0) == []


def test_forget_replica_and_sweep():
    m = AssignmentMemory(ttl_s=10)
    for i in range(5):
        m.record(f"a{i}@1", "r1", now=i)
    m.record("a4@1", "r2", now=4)
    m.forget_replica("r1")
    assert m.where("a4@1", now=5) == ["r2"] and m.where("a0@1", now=5) == []
    m.record("b@1", "r3", now=20)
    m.sweep(now=20)  # every adapter whose newest assignment expired goes, looked up or not
    assert len(m) == 1 and m.where("b@1", now=20) == ["r3"]


def test_ttl_must_be_positive():
    with pytest.raises(ValueError):
        AssignmentMemory(0)


def test_entries_and_forget():
    m = AssignmentMemory(ttl_s=30.0)
    m.record("a@1", "r1", 100.0)
    m.record("a@1", "r2", 101.0)
    assert m.entries("a@1", 105.0) == [("r1", 100.0), ("r2", 101.0)]
    m.forget("a@1", "r1")
    assert m.where("a@1", 105.0) == ["r2"]
    m.forget("a@1", "r2")
    assert m.where("a@1", 105.0) == [] and len(m) == 0


def test_stats_newer_than_an_assignment_override_it():
    """The router's memory says 'sent to r1 at t'; r1's stats taken well after t without the adapter (neither held
    nor loading) mean it was evicted since: the memory must not keep routing there (a reload each time)."""
    from app.router.routing.assignments import STATS_LAG_S, dropped_since

    t = 1000.0
    assert not dropped_since(
        ReplicaStats("r1", at=t + 0.5), "a@1", t
    )  # too soon: the load may not have begun
    assert not dropped_since(ReplicaStats("r1"), "a@1", t)  # no report yet: trust the memory
    late = t + STATS_LAG_S + 0.1
    assert dropped_since(ReplicaStats("r1", at=late, resident=("b@1",)), "a@1", t)
    assert not dropped_since(ReplicaStats("r1", at=late, resident=("a@1",)), "a@1", t)
    assert not dropped_since(ReplicaStats("r1", at=late, loading=("a@1",)), "a@1", t)


def test_confirmed_skips_gone_replicas_and_forgets_dropped_ones():
    """What the router (and the simulator) route on: memory entries less replicas that are gone and replicas whose
    newer stats show the adapter dropped; the dropped ones are forgotten, the gone ones left to forget_replica."""
    from app.router.routing.assignments import STATS_LAG_S

    m = AssignmentMemory(ttl_s=30.0)
    for rid, t in (("r1", 100.0), ("r2", 100.5), ("r3", 101.0)):
        m.record("a@1", rid, t)
    late = 101.0 + STATS_LAG_S + 0.1
    stats = {
        "r1": ReplicaStats("r1", at=late, resident=("b@1",)),  # evicted since
        "r3": ReplicaStats("r3", at=late, resident=("a@1",)),
    }  # r2: not among the live replicas
    assert m.confirmed("a@1", 105.0, stats.get) == ["r3"]
    assert m.where("a@1", 105.0) == ["r2", "r3"]  # r1 forgotten; r2 kept until its replica is declared dead
