"""From an adapter source (a folder, s3://, hf://, file://) to validated LoraWeights for one base model."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.config.model_config import ModelConfig
from app.errors import AdapterUnavailable, InvalidAdapter
from app.replica.lora.peft_format import read_adapter
from app.replica.lora.weights import LoraWeights

log = logging.getLogger("loraland.kernel")


def _without_paths(err: Exception, name: str, folder: Path | None, source: str | Path) -> Exception:
    """`err` naming the adapter instead of where it is: the message reaches the tenant who sent the request
    (a 400 or 503), and the disk cache's layout, a local source folder or the bucket behind an adapter are none
    of the tenant's business. The server log keeps the original."""
    text = str(source)
    places = {text, str(Path(text.removeprefix("file://")).expanduser())}
    if folder is not None:
        places |= {str(folder), str(folder.resolve())}
    message = str(err)
    for place in sorted(places, key=len, reverse=True):  # the longest first: one may contain another
        message = message.replace(place, repr(name))
    if message == str(err):
        return err
    log.info("adapter %s (%s): %s", name, source, err)
    out = type(err)(message)
    out.__dict__.update(err.__dict__)
    return out


class AdapterReader:
    """Fetches adapters through an AdapterHub (verified, cached) and reads them against one base model."""

    def __init__(self, model_config: ModelConfig, max_rank: int, hub: Any = None):
        self.model_config, self.max_rank = model_config, max_rank
        self._hub = hub

    @property
    def hub(self) -> Any:
        if self._hub is None:
            from app.catalog.sources import AdapterHub

            self._hub = AdapterHub()
        return self._hub

    def folder(self, source: str | Path, files: dict[str, str] | None = None) -> Path:
        """A local adapter folder for `source`: a folder as is, s3:// hf:// file:// (or anything with expected
        checksums) through the hub, which verifies and caches it."""
        text = str(source)
        if files or text.startswith(("s3://", "hf://", "file://")):
            return Path(self.hub.fetch(text, files=files))
        p = Path(text).expanduser()
        if not p.is_dir():
            raise InvalidAdapter(
                f"adapter source {text!r} is not a folder nor an s3://, hf:// or file:// URI"
            )
        return p

    def read(self, source: str | Path, name: str, files: dict[str, str] | None = None) -> LoraWeights:
        t0, c0 = time.perf_counter(), time.thread_time()
        folder = None
        try:
            folder = self.folder(source, files)
            t1, c1 = time.perf_counter(), time.thread_time()
            weights = read_adapter(folder, self.model_config, max_rank=self.max_rank, name=name)
        except (InvalidAdapter, AdapterUnavailable) as e:
            raise _without_paths(e, name, folder, source) from None
        # Wall and this thread's CPU time: a wide gap means the load waited (network, disk, CPU, GIL).
        log.info(
            "adapter %s: fetched in %.1f ms (%.1f ms CPU), read and validated in %.1f ms (%.1f ms CPU)",
            name,
            (t1 - t0) * 1e3,
            (c1 - c0) * 1e3,
            (time.perf_counter() - t1) * 1e3,
            (time.thread_time() - c1) * 1e3,
        )
        return weights

    def loader(
        self, source: str | Path, name: str, files: dict[str, str] | None = None
    ) -> Callable[[], LoraWeights]:
        """The re-read the AdapterManager runs after evicting the adapter from host memory: a source that fails
        for any other reason than a bad adapter is unavailable (retry later), not invalid."""

        def reload() -> LoraWeights:
            try:
                return self.read(source, name, files)
            except (InvalidAdapter, AdapterUnavailable):
                raise
            except Exception as e:  # the details (paths, hosts) go to the log, not to the caller
                log.warning("re-reading adapter %s from %s failed: %r", name, source, e)
                raise AdapterUnavailable(
                    f"re-reading adapter {name!r} failed ({type(e).__name__}); retry later"
                ) from e

        return reload
