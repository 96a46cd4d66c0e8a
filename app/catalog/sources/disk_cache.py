"""The local disk cache of downloaded adapters: ROOT/<key>/ holds the files, ROOT/<key>.json their manifest and
source. A download lands in a staging folder first and is renamed into place only once verified, so a reader
never sees a partial adapter; a folder without its manifest (a crash between the two steps) is ignored and
replaced. Bounded by bytes: least recently used entries go first (use = the manifest's mtime)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
_STALE_S = 3600.0  # staging folders older than this belong to a dead process


class DiskCache:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._ready = False

    def _init(self) -> None:
        # Created on first use, so building an AdapterHub touches no disk.
        if self._ready:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        now = time.time()
        for p in self.root.glob(".tmp-*"):
            with contextlib.suppress(OSError):
                if now - p.stat().st_mtime > _STALE_S:
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()
        for p in self.root.glob(".trash-*"):
            shutil.rmtree(p, ignore_errors=True)
        self._ready = True

    def _meta_path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def lookup(self, key: str) -> tuple[Path, dict[str, Any]] | None:
        """The cached folder and its manifest, marking it used; None on a miss."""
        folder, meta_path = self.root / key, self._meta_path(key)
        try:
            meta = json.loads(meta_path.read_text())
            if not folder.is_dir():
                return None
            os.utime(meta_path)
        except (OSError, ValueError):
            return None
        return folder, meta

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A fresh folder inside the cache (same filesystem, so the final rename is atomic); removed with
        whatever is in it unless commit() moved it into place."""
        self._init()
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))
        try:
            yield tmp
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        # Several processes (replicas on one host) may share the cache.
        with open(self.root / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def commit(self, key: str, staged: Path, meta: dict[str, Any], *, replace: bool) -> Path:
        """Move a verified staging folder to ROOT/key and write its manifest; then evict down to max_bytes.
        With replace=False an existing complete entry wins (content-addressed keys: it is the same content)."""
        final, meta_path = self.root / key, self._meta_path(key)
        with self._lock():
            if final.exists():
                if not replace and meta_path.exists():
                    os.utime(meta_path)
                    return final
                meta_path.unlink(missing_ok=True)
                trash = Path(tempfile.mkdtemp(prefix=".trash-", dir=self.root))
                os.rename(final, trash / key.replace("/", "_"))
                shutil.rmtree(trash, ignore_errors=True)
            os.rename(staged, final)
            tmp_meta = self.root / f".tmp-{key}.json"
            tmp_meta.write_text(json.dumps(meta))
            os.replace(tmp_meta, meta_path)
            self._evict(keep=key)
        return final

    def entries(self) -> list[dict[str, Any]]:
        """Complete entries, least recently used first: [{key, size, used, uri}]."""
        if not self.root.is_dir():
            return []
        out = []
        for meta_path in self.root.glob("*.json"):
            key = meta_path.name[: -len(".json")]
            if key.startswith("."):  # a manifest being written
                continue
            try:
                meta = json.loads(meta_path.read_text())
                used = meta_path.stat().st_mtime
            except (OSError, ValueError):
                continue
            if (self.root / key).is_dir():
                out.append(
                    {"key": key, "size": int(meta.get("size", 0)), "used": used, "uri": meta.get("uri")}
                )
        return sorted(out, key=lambda e: e["used"])

    def remove(self, key: str) -> None:
        self._meta_path(key).unlink(missing_ok=True)
        shutil.rmtree(self.root / key, ignore_errors=True)

    def _evict(self, keep: str) -> None:
        entries = self.entries()
        total = sum(e["size"] for e in entries)
        for e in entries:
            if total <= self.max_bytes:
                break
            if e["key"] == keep:
                continue
            # The manifest goes first: from then on the entry is a miss, even while its files are deleted.
            self.remove(e["key"])
            total -= e["size"]
            log.info("disk cache: evicted %s (%d bytes, %s)", e["key"], e["size"], e["uri"])
        if total > self.max_bytes:
            log.warning(
                "disk cache over its %d-byte limit with only %s left: raise LORALAND_MAX_CACHE_BYTES",
                self.max_bytes,
                keep,
            )
