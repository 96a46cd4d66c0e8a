"""What counts as an adapter's files, and the checks every source applies to them: the size limit and the
sha256s the catalog recorded at registration."""

from __future__ import annotations

import fnmatch
from pathlib import Path

from app.errors import AdapterUnavailable, InvalidAdapter
from app.files import sha256_file

# The files that make up a published adapter; anything else (pickles, checkpoints, logs) is not fetched.
ADAPTER_PATTERNS = ("*.json", "*.safetensors", "*.md", "*.txt")


def is_adapter_file(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return not name.startswith(".") and any(fnmatch.fnmatch(name, p) for p in ADAPTER_PATTERNS)


def adapter_files(folder: Path) -> list[str]:
    """Relative paths of the adapter files in `folder` (recursively, hidden files skipped)."""
    return sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file()
        and is_adapter_file(p.relative_to(folder).as_posix())
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def hash_folder(folder: Path, files: list[str] | None = None) -> dict[str, str]:
    """{relative path: sha256} of `files` (default: the adapter files) in folder."""
    folder = Path(folder)
    return {rel: sha256_file(folder / rel) for rel in (files if files is not None else adapter_files(folder))}


def mismatch(uri: str, rel: str, got: str, want: str) -> InvalidAdapter:
    return InvalidAdapter(
        f"{uri}: checksum mismatch for {rel} (sha256 {got[:12]}..., registered {want[:12]}...): the file "
        "changed after registration; re-register the adapter if the change is intended"
    )


def check_size(uri: str, size: int, limit: int) -> None:
    if size > limit:
        raise InvalidAdapter(
            f"{uri}: adapter is {size} bytes, over the {limit}-byte limit (LORALAND_MAX_ADAPTER_BYTES)"
        )


def verify_files(uri: str, folder: Path, files: dict[str, str]) -> None:
    """Every file in `files` ({relative path: sha256}) is in `folder` with that sha256."""
    for rel, want in sorted(files.items()):
        path = folder / rel
        if not path.is_file():
            raise AdapterUnavailable(
                f"{uri}: {rel} is missing (it was registered with the adapter): push it again"
            )
        got = sha256_file(path)
        if got != want:
            raise mismatch(uri, rel, got, want)
