"""Setting environment variables for a while in this process, and putting back exactly what was there.

The local cluster, the local stack and the test fixtures each point os.environ at their Redis, S3 and Ray for the
CLI and drivers they run in-process; a value left behind leaks into every later test (tests/conftest.py fails a
module that leaks one). One class, so the save/restore is written once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


class EnvPatch:
    """`EnvPatch(env)` sets `env` in os.environ now; `restore()` (or leaving a `with` block) puts back each key's
    previous value, removing the keys that were absent. Restoring twice does nothing the second time."""

    def __init__(self, env: Mapping[str, str]):
        self.previous: dict[str, str | None] = {k: os.environ.get(k) for k in env}
        os.environ.update(env)

    def restore(self) -> None:
        previous, self.previous = self.previous, {}
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def __enter__(self) -> EnvPatch:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
