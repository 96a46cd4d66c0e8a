"""File helpers shared by every layer: the one sha256-of-a-file, and the check that a relative path from an
untrusted listing (S3 keys, Hub files, a manifest) cannot write outside the folder it lands in."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path, PurePosixPath

from app.errors import InvalidRequest


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def safe_relpath(path: str, *, where: str = "", error: type[Exception] = InvalidRequest) -> str:
    """Return `path` if it is a plain relative path (no '..', no absolute or empty parts, no backslashes),
    else raise `error`: such a key would write outside the folder it is downloaded into."""
    bad = (
        not path
        or "\\" in path
        or "\x00" in path
        or path.startswith("/")
        or re.match(r"^[A-Za-z]:", path) is not None
        or any(part in ("", ".", "..") for part in path.split("/"))
    )
    if bad:
        src = f" in {where}" if where else ""
        raise error(
            f"unsafe file path {path!r}{src}: adapter files must have plain relative names "
            "(no '..', no leading '/', no empty or '.' parts, no backslashes)"
        )
    return str(PurePosixPath(path))
