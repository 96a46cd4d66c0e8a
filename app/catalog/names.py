"""Names the catalog accepts: adapter names and refs (`name`, `org/name`, `name@3`), tenant names, and the
relative paths of an adapter's files (S3 keys, Hub files) that may be written under a cache folder."""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from app.errors import InvalidRequest

_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
ADAPTER_NAME_RE = re.compile(rf"^{_SEGMENT}(?:/{_SEGMENT})?$")
TENANT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_NAME_RULE = (
    "adapter names are 1-128 characters from [A-Za-z0-9._-], starting with a letter or digit, "
    "optionally prefixed once by 'org/' (same rule), e.g. 'acme/sql-expert'"
)


def check_name(name: str) -> str:
    """Return `name` if it is a valid adapter name; raise InvalidRequest naming the rule otherwise."""
    if not isinstance(name, str) or not ADAPTER_NAME_RE.match(name):
        raise InvalidRequest(f"invalid adapter name {name!r}: {_NAME_RULE}")
    return name


def check_tenant(name: str) -> str:
    if not isinstance(name, str) or not TENANT_NAME_RE.match(name):
        raise InvalidRequest(
            f"invalid tenant name {name!r}: 1-64 characters from [A-Za-z0-9._-], starting with a letter or digit"
        )
    return name


def parse_ref(ref: str) -> tuple[str, int | None]:
    """'name' -> (name, None) meaning the newest version; 'name@3' -> (name, 3)."""
    if not isinstance(ref, str):
        raise InvalidRequest(f"adapter reference must be a string, got {type(ref).__name__}")
    name, sep, version = ref.partition("@")
    check_name(name)
    if not sep:
        return name, None
    if not version.isdigit() or int(version) < 1 or version != str(int(version)):
        raise InvalidRequest(
            f"invalid version in {ref!r}: use name@N with N a positive integer, e.g. {name}@1"
        )
    return name, int(version)


def format_ref(name: str, version: int | None) -> str:
    return name if version is None else f"{name}@{version}"


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
