"""AdapterHub: from a name or a source URI to a verified local adapter folder.

Sources: s3://bucket/prefix (boto3, into the disk cache), hf://org/repo[@revision] (huggingface_hub's own
cache, offline mode honoured), and local folders (/path or file:///path; restricted to configured roots when
the request came over HTTP). When the catalog recorded sha256s, every file is checked against them; a
mismatch is refused and nothing partial is kept."""

from __future__ import annotations

import fnmatch
import hashlib
import sys
from pathlib import Path
from typing import Any

from app.catalog import s3
from app.catalog.disk_cache import DiskCache
from app.catalog.records import AdapterRecord, manifest_sha256
from app.config.settings import Settings
from app.errors import AdapterUnavailable, InvalidAdapter, InvalidRequest, UnknownAdapter
from app.files import safe_relpath, sha256_file
from app.names import check_name, parse_ref

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


def _mismatch(uri: str, rel: str, got: str, want: str) -> str:
    return (
        f"{uri}: checksum mismatch for {rel} (sha256 {got[:12]}..., registered {want[:12]}...): the file "
        "changed after registration; re-register the adapter if the change is intended"
    )


class _HubMissing(AdapterUnavailable):
    """The Hub (or its offline cache) has no such repo or revision: for get(), an unknown name."""


class AdapterHub:
    def __init__(self, *, catalog: Any | None = None, settings: Settings | None = None) -> None:
        self.settings = settings or Settings.from_env()
        self._catalog = catalog
        self._catalog_resolved = catalog is not None
        self.cache = DiskCache(self.settings.cache_dir / "adapters", self.settings.max_cache_bytes)

    @property
    def catalog(self) -> Any | None:
        # Connected on first use, so a hub for local/HF adapters never needs Redis.
        if not self._catalog_resolved:
            from app.catalog.store import Catalog

            self._catalog = Catalog.from_settings(self.settings)
            self._catalog_resolved = True
        return self._catalog

    # ----------------------------------------------------------------- by name

    def get(self, name: str) -> Path:
        """Resolve `name` (or `name@v`) to a verified local folder: the catalog, then the local roots
        (LORALAND_ADAPTER_PATH, each holding name/ or org/name/ folders), then the Hugging Face Hub."""
        return self.resolve(name)[0]

    def resolve(self, name: str) -> tuple[Path, AdapterRecord | None]:
        """Like get(), also returning the catalog record when the name came from the catalog."""
        base, version = parse_ref(name)
        looked: list[str] = []
        catalog = self.catalog
        if catalog is not None:
            record = catalog.get(name)
            if record is not None:
                return self.fetch(record.uri, files=record.files), record
            looked.append(f"the catalog at {catalog.url}")
        if version is not None:
            raise UnknownAdapter(
                f"no adapter {name!r}: versions (@{version}) exist only in the catalog; looked in "
                + (", ".join(looked) or "no catalog (LORALAND_REDIS_URL is unset)")
            )
        for root in self.settings.adapter_path:
            folder = root / base
            if (folder / "adapter_config.json").is_file():
                return self.fetch(str(folder)), None
            looked.append(str(folder))
        if "/" in base:
            try:
                return self._fetch_hf(f"hf://{base}", None), None
            except _HubMissing as e:
                looked.append(f"the Hugging Face Hub ({e})")
        else:
            looked.append("not the Hugging Face Hub (Hub ids are org/name)")
        raise UnknownAdapter(f"adapter {name!r} not found; looked in: " + "; ".join(looked))

    # ----------------------------------------------------------------- by URI

    def fetch(self, uri: str, *, files: dict[str, str] | None = None, untrusted: bool = False) -> Path:
        """The local folder for a source URI, with every file in `files` checked against its sha256."""
        if not isinstance(uri, str) or not uri:
            raise InvalidRequest("adapter source must be a non-empty string")
        for rel in files or {}:
            safe_relpath(rel, where=uri, error=InvalidAdapter)
        if uri.startswith("s3://"):
            return self._fetch_s3(uri, files)
        if uri.startswith("hf://"):
            return self._fetch_hf(uri, files)
        if uri.startswith("file://") or "://" not in uri:
            return self._fetch_local(uri, files, untrusted)
        raise InvalidRequest(
            f"unsupported adapter source {uri!r}: use s3://bucket/prefix, hf://org/repo[@rev] or a folder"
        )

    def _check_size(self, uri: str, size: int) -> None:
        limit = self.settings.max_adapter_bytes
        if size > limit:
            raise InvalidAdapter(
                f"{uri}: adapter is {size} bytes, over the {limit}-byte limit (LORALAND_MAX_ADAPTER_BYTES)"
            )

    def _verify(self, uri: str, folder: Path, files: dict[str, str]) -> None:
        for rel, want in sorted(files.items()):
            path = folder / rel
            if not path.is_file():
                raise AdapterUnavailable(
                    f"{uri}: {rel} is missing (it was registered with the adapter): push it again"
                )
            got = sha256_file(path)
            if got != want:
                raise InvalidAdapter(_mismatch(uri, rel, got, want))

    def _fetch_local(self, uri: str, files: dict[str, str] | None, untrusted: bool) -> Path:
        folder = Path(uri[len("file://") :] if uri.startswith("file://") else uri).expanduser()
        if untrusted:
            roots = [r.resolve() for r in self.settings.allowed_local_roots]
            real = folder.resolve()
            if not any(real.is_relative_to(r) for r in roots):
                raise InvalidRequest(
                    f"local adapter folder {uri!r} is outside the allowed roots "
                    f"({', '.join(map(str, roots)) or 'none: set LORALAND_LOCAL_ROOTS'}); register it instead"
                )
            for p in real.rglob("*"):  # a symlink inside the root may point anywhere
                if not any(p.resolve().is_relative_to(r) for r in roots):
                    raise InvalidRequest(f"{p} links outside the allowed local roots: refused")
        if not folder.is_dir():
            raise AdapterUnavailable(f"{uri}: no such folder")
        names = list(files) if files else adapter_files(folder)
        self._check_size(uri, sum((folder / n).stat().st_size for n in names if (folder / n).is_file()))
        if files:
            self._verify(uri, folder, files)
        return folder

    def _fetch_s3(self, uri: str, files: dict[str, str] | None) -> Path:
        bucket, prefix = s3.parse_s3_uri(uri)
        if files:  # content-addressed: a hit needs no network, so a cached adapter survives S3 being down
            key = "sha-" + manifest_sha256(files)[:40]
            hit = self.cache.lookup(key)
            if hit is not None:
                return hit[0]
        client = s3.client()
        if files:  # the catalog names every file: fetch them directly, no listing round trip
            wanted = {rel: f"{prefix}/{rel}" for rel in files}
        else:
            objects = s3.list_objects(client, bucket, prefix, uri)
            found = {rel: o for rel, o in objects.items() if is_adapter_file(rel)}
            if not found:
                raise AdapterUnavailable(
                    f"{uri}: no adapter files under this prefix (no such key): check the URI"
                )
            key = "uri-" + hashlib.sha256(uri.encode()).hexdigest()[:40]
            hit = self.cache.lookup(key)
            if hit is not None and hit[1].get("etags") == {rel: o.etag for rel, o in found.items()}:
                return hit[0]
            self._check_size(uri, sum(o.size for o in found.values()))
            wanted = {rel: o.key for rel, o in found.items()}
        with self.cache.staging() as tmp:
            left, got, etags = self.settings.max_adapter_bytes, {}, {}
            for rel, obj_key in sorted(wanted.items()):
                got[rel], n, etags[rel] = s3.download(
                    client,
                    bucket,
                    obj_key,
                    tmp / rel,
                    limit=left,
                    cap=self.settings.max_adapter_bytes,
                    uri=uri,
                )
                left -= n
                if files and got[rel] != files[rel]:  # hashed while downloading: no second read
                    raise InvalidAdapter(_mismatch(uri, rel, got[rel], files[rel]))
            size = self.settings.max_adapter_bytes - left
            meta = {"uri": uri, "files": got, "size": size, "etags": etags}
            return self.cache.commit(key, tmp, meta, replace=not files)

    def _fetch_hf(self, uri: str, files: dict[str, str] | None) -> Path:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import (
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        repo, _, rev = uri[len("hf://") :].partition("@")
        check_name(repo)
        try:
            folder = Path(
                snapshot_download(repo_id=repo, revision=rev or None, allow_patterns=list(ADAPTER_PATTERNS))
            )
        except RevisionNotFoundError:
            raise _HubMissing(f"{uri}: revision {rev!r} not found on the Hub") from None
        except RepositoryNotFoundError:
            raise _HubMissing(
                f"{uri}: no such repository on the Hub, or it is private/gated (set HF_TOKEN)"
            ) from None
        except LocalEntryNotFoundError:
            how = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
            raise _HubMissing(
                f"{uri}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {how}"
            ) from None
        except (HfHubHTTPError, OSError) as e:
            raise AdapterUnavailable(f"{uri}: Hugging Face Hub request failed ({e})") from None
        if files:
            self._verify(uri, folder, files)
        self._check_size(uri, sum((folder / n).stat().st_size for n in adapter_files(folder)))
        return folder

    # ----------------------------------------------------------------- upload

    def upload(
        self,
        folder: Path,
        dest_uri: str,
        progress: bool = False,
        *,
        files: list[str] | None = None,
        overwrite: bool = False,
    ) -> dict[str, str]:
        """Upload an adapter folder's files to s3://bucket/prefix; returns {file: sha256}. Refuses to replace
        different content already there unless overwrite=True (versions registered from it would then fail
        their checksum): push each version to its own prefix."""
        from tqdm import tqdm

        bucket, prefix = s3.parse_s3_uri(dest_uri) if dest_uri.startswith("s3://") else (None, None)
        if bucket is None:
            raise InvalidRequest(f"upload supports s3://bucket/prefix destinations only, not {dest_uri!r}")
        folder = Path(folder)
        names = sorted(files) if files is not None else adapter_files(folder)
        if not names:
            raise InvalidAdapter(f"{folder}: no adapter files to upload (adapter_config.json, *.safetensors)")
        for rel in names:
            safe_relpath(rel, where=str(folder), error=InvalidAdapter)
        sums = hash_folder(folder, names)
        total = sum((folder / rel).stat().st_size for rel in names)
        self._check_size(str(folder), total)
        client = s3.client()
        if not overwrite:
            for rel, sha in sums.items():
                there = s3.stored_sha256(client, bucket, f"{prefix}/{rel}", dest_uri)
                if there is not None and there != sha:
                    raise InvalidRequest(
                        f"{dest_uri}/{rel} already exists with different content: push this version to a new prefix "
                        "(e.g. .../v2), or overwrite (--overwrite) if no registered version uses it"
                    )
        with tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc=f"upload {dest_uri}",
            disable=not progress,
            file=sys.stderr,
            leave=True,
        ) as bar:
            for rel in names:
                s3.upload(
                    client,
                    folder / rel,
                    bucket,
                    f"{prefix}/{rel}",
                    sums[rel],
                    uri=dest_uri,
                    progress=bar.update,
                )
        return sums
