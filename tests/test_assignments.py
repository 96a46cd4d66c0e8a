"""The router's memory of where it just sent each adapter (app/router/assignments.py): what makes an adapter
warm for placement.py, shared by AdapterAffinityRouter and the placement simulator."""

import pytest

from app.router.assignments import AssignmentMemory


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
