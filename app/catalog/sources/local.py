"""Local adapter folders: /path or file:///path. The admin may name any folder; a request that came over HTTP
(`untrusted`) may only name folders under the allowed roots (LORALAND_LOCAL_ROOTS), symlinks included."""

from __future__ import annotations

from pathlib import Path

from app.catalog.sources.verify import adapter_files, check_size, verify_files
from app.errors import AdapterUnavailable, InvalidRequest


def _resolve(path: Path, uri: str) -> Path:
    # Path.resolve raises RuntimeError on a symlink loop (Python < 3.13) and OSError on unreadable parts: both
    # are a folder that cannot be served, not a server error.
    try:
        return path.resolve()
    except (OSError, RuntimeError) as e:
        raise InvalidRequest(
            f"local adapter folder {uri!r}: cannot resolve {path.name!r} ({e}): refused"
        ) from None


def _check_roots(uri: str, folder: Path, allowed_roots: tuple[Path, ...]) -> Path:
    """The folder's real path, if it and everything in it (symlinks followed) is under an allowed root."""
    roots = [r.resolve() for r in allowed_roots]
    real = _resolve(folder, uri)
    if not any(real.is_relative_to(r) for r in roots):
        raise InvalidRequest(
            f"local adapter folder {uri!r} is outside the allowed roots "
            f"({', '.join(map(str, roots)) or 'none: set LORALAND_LOCAL_ROOTS'}); register it instead"
        )
    try:
        inside = list(real.rglob("*"))
    except (OSError, RuntimeError) as e:
        raise InvalidRequest(f"local adapter folder {uri!r} cannot be listed ({e}): refused") from None
    for p in inside:  # a symlink inside the root may point anywhere
        if not any(_resolve(p, uri).is_relative_to(r) for r in roots):
            raise InvalidRequest(f"{p} links outside the allowed local roots: refused")
    return real


def fetch(
    uri: str,
    files: dict[str, str] | None,
    *,
    untrusted: bool,
    allowed_roots: tuple[Path, ...],
    max_bytes: int,
) -> Path:
    """The folder itself (nothing is copied), size-checked and, when `files` is given, sha256-checked."""
    if "\x00" in uri:
        raise InvalidRequest(f"local adapter folder {uri!r}: a path cannot contain a NUL byte")
    try:
        folder = Path(uri[len("file://") :] if uri.startswith("file://") else uri).expanduser()
    except RuntimeError as e:  # ~user that does not exist
        raise InvalidRequest(f"local adapter folder {uri!r}: {e}") from None
    if untrusted:  # from here on the real path: a symlink swapped in above it later changes nothing
        folder = _check_roots(uri, folder, allowed_roots)
    if not folder.is_dir():
        raise AdapterUnavailable(f"{uri}: no such folder")
    names = list(files) if files else adapter_files(folder)
    check_size(uri, sum((folder / n).stat().st_size for n in names if (folder / n).is_file()), max_bytes)
    if files:
        verify_files(uri, folder, files)
    return folder
