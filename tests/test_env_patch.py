"""EnvPatch: the one save/restore of os.environ the local cluster, the local stack and the fixtures share."""

from __future__ import annotations

import os

from app.config.env_patch import EnvPatch


def test_restore_puts_back_previous_values_and_removes_new_keys(monkeypatch):
    monkeypatch.setenv("LORALAND_T_KEEP", "old")
    monkeypatch.delenv("LORALAND_T_NEW", raising=False)
    patch = EnvPatch({"LORALAND_T_KEEP": "new", "LORALAND_T_NEW": "x"})
    assert (os.environ["LORALAND_T_KEEP"], os.environ["LORALAND_T_NEW"]) == ("new", "x")
    patch.restore()
    assert os.environ["LORALAND_T_KEEP"] == "old" and "LORALAND_T_NEW" not in os.environ
    os.environ["LORALAND_T_KEEP"] = "changed later"
    patch.restore()  # a second restore changes nothing
    assert os.environ["LORALAND_T_KEEP"] == "changed later"


def test_as_a_context_manager(monkeypatch):
    monkeypatch.delenv("LORALAND_T_CTX", raising=False)
    with EnvPatch({"LORALAND_T_CTX": "1"}):
        assert os.environ["LORALAND_T_CTX"] == "1"
    assert "LORALAND_T_CTX" not in os.environ
