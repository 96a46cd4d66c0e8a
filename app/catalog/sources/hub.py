"""AdapterHub: from a name or a source URI to a verified local adapter folder.

By name: the catalog (LORALAND_REDIS_URL), then the local roots (LORALAND_ADAPTER_PATH), then the Hugging Face
Hub. By URI: s3:// (s3.py), hf:// (hf.py) or a local folder (local.py). When the catalog recorded sha256s,
every file is checked against them; a mismatch is refused and nothing partial is kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.adapter_record import AdapterRecord, manifest_sha256
from app.catalog.sources import hf, local, s3
from app.catalog.sources.disk_cache import DiskCache
from app.catalog.sources.verify import adapter_files, check_size, hash_folder
from app.config.settings import Settings
from app.errors import InvalidAdapter, InvalidRequest, UnknownAdapter
from app.files import safe_relpath
from app.names import parse_ref


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
                return hf.fetch(f"hf://{base}", None, max_bytes=self.settings.max_adapter_bytes), None
            except hf.HubMissing as e:
                looked.append(f"the Hugging Face Hub ({e})")
        else:
            looked.append("not the Hugging Face Hub (Hub ids are org/name)")
        raise UnknownAdapter(f"adapter {name!r} not found; looked in: " + "; ".join(looked))

    # ----------------------------------------------------------------- by URI

    def fetch(
        self,
        uri: str,
        *,
        files: dict[str, str] | None = None,
        untrusted: bool = False,
        progress: bool = False,
    ) -> Path:
        """The local folder for a source URI, with every file in `files` checked against its sha256. `progress`:
        a progress bar on stderr for S3 downloads (the Hub's own bars show for hf://)."""
        if not isinstance(uri, str) or not uri:
            raise InvalidRequest("adapter source must be a non-empty string")
        for rel in files or {}:
            safe_relpath(rel, where=uri, error=InvalidAdapter)
        limit = self.settings.max_adapter_bytes
        if uri.startswith("s3://"):
            return s3.fetch(
                uri, files, cache=self.cache, settings=self.settings.s3, max_bytes=limit, progress=progress
            )
        if uri.startswith("hf://"):
            return hf.fetch(uri, files, max_bytes=limit)
        if uri.startswith("file://") or "://" not in uri:
            return local.fetch(
                uri,
                files,
                untrusted=untrusted,
                allowed_roots=self.settings.allowed_local_roots,
                max_bytes=limit,
            )
        raise InvalidRequest(
            f"unsupported adapter source {uri!r}: use s3://bucket/prefix, hf://org/repo[@rev] or a folder"
        )

    def cached(self, uri: str, files: dict[str, str] | None) -> bool:
        """Whether fetch(uri, files=files) would be served from the disk cache (an S3 adapter the catalog
        describes, already downloaded): the `source` label of a replica's load metrics."""
        key = self.cache_key(uri, files)
        return key is not None and self.cache.lookup(key) is not None

    @staticmethod
    def cache_key(uri: str, files: dict[str, str] | None) -> str | None:
        """The disk cache entry fetch(uri, files=files) uses (s3.fetch's content-addressed key), or None when it
        uses none (local folders are read in place; the Hub keeps its own cache)."""
        if not (uri.startswith("s3://") and files):
            return None
        return "sha-" + manifest_sha256(files)[:40]

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
        if not dest_uri.startswith("s3://"):
            raise InvalidRequest(f"upload supports s3://bucket/prefix destinations only, not {dest_uri!r}")
        s3.parse_s3_uri(dest_uri)
        folder = Path(folder)
        names = sorted(files) if files is not None else adapter_files(folder)
        if not names:
            raise InvalidAdapter(f"{folder}: no adapter files to upload (adapter_config.json, *.safetensors)")
        for rel in names:
            safe_relpath(rel, where=str(folder), error=InvalidAdapter)
        sums = hash_folder(folder, names)
        total = sum((folder / rel).stat().st_size for rel in names)
        check_size(str(folder), total, self.settings.max_adapter_bytes)
        s3.upload(folder, sums, dest_uri, settings=self.settings.s3, overwrite=overwrite, progress=progress)
        return sums
