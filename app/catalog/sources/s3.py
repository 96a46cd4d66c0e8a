"""s3://bucket/prefix: adapters in S3 or an S3-compatible store, fetched into the disk cache; and uploads to it.

A fetch the catalog describes (`files`: {name: sha256}) is content-addressed in the cache, so a hit needs no
network at all and a cached adapter survives S3 being down; an adapter's files download in parallel, each hashed
while it downloads (no second read, and no response CRC over the same bytes). A fetch by
bare URI lists the prefix and is cached by URI, refreshed when the objects' ETags change. The boto3 calls and
their error messages are in s3_api.py.

A URI names a bucket and a prefix, never a host: the bucket must be a plain S3 bucket name, because botocore
turns an access-point or Outposts ARN, an S3 Express directory bucket (`--x-s3`) or a multi-region access point
given as the bucket into a request to another host (`myap-123456789012.<endpoint>`), and a URI sent by an API
caller must not choose where the server connects. With a configured endpoint, requests are path-style
(s3_api.py), so the host is exactly AWS_ENDPOINT_URL's."""

from __future__ import annotations

import functools
import hashlib
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from app.adapter_record import manifest_sha256
from app.catalog.sources import s3_api
from app.catalog.sources.disk_cache import DiskCache
from app.catalog.sources.verify import check_size, is_adapter_file, mismatch
from app.config.settings import S3Settings
from app.errors import AdapterUnavailable, InvalidRequest
from app.files import safe_relpath

# AWS's bucket naming rules: 3-63 characters, lowercase letters, digits, '.', '-', a letter or digit at each
# end, no '..', not an IPv4 address; the reserved prefixes and suffixes name aliases that route elsewhere.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IPV4_RE = re.compile(r"^\d+\.\d+\.\d+\.\d+$")
_RESERVED_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_RESERVED_SUFFIXES = ("-s3alias", "--ol-s3", "--x-s3", "--table-s3", ".mrap")


def check_bucket(bucket: str, uri: str) -> str:
    """`bucket` if it is a plain S3 bucket name; InvalidRequest otherwise (see the module docstring)."""
    bad = (
        not _BUCKET_RE.match(bucket)
        or ".." in bucket
        or _IPV4_RE.match(bucket) is not None
        or bucket.startswith(_RESERVED_PREFIXES)
        or bucket.endswith(_RESERVED_SUFFIXES)
    )
    if bad:
        raise InvalidRequest(
            f"S3 URI {uri[:200]!r}: {bucket[:100]!r} is not a plain S3 bucket name (3-63 characters from a-z, "
            "0-9, '.' and '-'; no ARNs, access-point aliases or IP addresses): adapters are read from buckets "
            "on the configured S3 endpoint only"
        )
    return bucket


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """'s3://bucket/some/prefix/' -> ('bucket', 'some/prefix')."""
    if not uri.startswith("s3://"):
        raise InvalidRequest(f"not an S3 URI: {uri!r}; use s3://bucket/prefix")
    bucket, _, prefix = uri[5:].partition("/")
    prefix = prefix.strip("/")
    if not bucket or not prefix:
        raise InvalidRequest(f"S3 URI {uri!r} needs a bucket and a prefix: s3://bucket/prefix")
    check_bucket(bucket, uri)
    safe_relpath(prefix, where=uri)
    return bucket, prefix


def fetch(
    uri: str,
    files: dict[str, str] | None,
    *,
    cache: DiskCache,
    settings: S3Settings,
    max_bytes: int,
    progress: bool = False,
) -> Path:
    """The cached folder for `uri`, downloading what is not cached; with `files`, every sha256 checked.
    `progress`: a progress bar on stderr while downloading (the CLI's)."""
    bucket, prefix = parse_s3_uri(uri)
    if files:
        key = "sha-" + manifest_sha256(files)[:40]
        hit = cache.lookup(key)
        if hit is not None:
            return hit[0]
    client = s3_api.client(settings)
    if files:  # the catalog names every file: fetch them directly, no listing round trip
        wanted = {rel: f"{prefix}/{rel}" for rel in files}
    else:
        objects = s3_api.list_objects(client, bucket, prefix, uri)
        found = {rel: o for rel, o in objects.items() if is_adapter_file(rel)}
        if not found:
            raise AdapterUnavailable(
                f"{uri}: no adapter files under this prefix (no such key): check the URI"
            )
        key = "uri-" + hashlib.sha256(uri.encode()).hexdigest()[:40]
        hit = cache.lookup(key)
        if hit is not None and hit[1].get("etags") == {rel: o.etag for rel, o in found.items()}:
            return hit[0]
        check_size(uri, sum(o.size for o in found.values()), max_bytes)
        wanted = {rel: o.key for rel, o in found.items()}
    from tqdm import tqdm

    total = None if files else sum(o.size for o in found.values())
    bar = tqdm(
        total=total, unit="B", unit_scale=True, desc=f"download {uri}", disable=not progress, file=sys.stderr
    )
    with cache.staging() as tmp, bar:
        budget, rels = s3_api.Budget(max_bytes), sorted(wanted)

        def one(rel: str) -> tuple[str, int, str]:
            return s3_api.download(
                client, bucket, wanted[rel], tmp / rel, budget=budget, uri=uri, progress=bar.update,
                checksum=not files,
            )  # fmt: skip

        # Every file at once: the adapter's latency is its largest file's, not the sum of round trips.
        futures = [_pool().submit(one, rel) for rel in rels]
        got, etags, failure = {}, {}, None
        for rel, fut in zip(rels, futures):
            try:
                got[rel], _, etags[rel] = fut.result()
            except BaseException as e:  # wait for the others (they write into tmp), then raise the first
                failure = failure or e
        if failure is not None:
            raise failure
        for rel in rels:
            if files and got[rel] != files[rel]:  # hashed while downloading: no second read
                raise mismatch(uri, rel, got[rel], files[rel])
        meta = {"uri": uri, "files": got, "size": budget.used(), "etags": etags}
        return cache.commit(key, tmp, meta, replace=not files)


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """The threads that download an adapter's files in parallel (boto3 releases the GIL while it waits)."""
    return ThreadPoolExecutor(max_workers=8, thread_name_prefix="loraland-s3-get")


def upload(
    folder: Path,
    sums: dict[str, str],
    dest_uri: str,
    *,
    settings: S3Settings,
    overwrite: bool,
    progress: bool,
) -> None:
    """Upload folder's files `sums` ({relative path: sha256}, recorded in each object's metadata) under
    dest_uri. Refuses to replace different content already there unless `overwrite`."""
    from tqdm import tqdm

    bucket, prefix = parse_s3_uri(dest_uri)
    client = s3_api.client(settings)
    if not overwrite:
        for rel, sha in sums.items():
            there = s3_api.stored_sha256(client, bucket, f"{prefix}/{rel}", dest_uri)
            if there is not None and there != sha:
                raise InvalidRequest(
                    f"{dest_uri}/{rel} already exists with different content: push this version to a new prefix "
                    "(e.g. .../v2), or overwrite (--overwrite) if no registered version uses it"
                )
    total = sum((folder / rel).stat().st_size for rel in sums)
    bar = tqdm(
        total=total, unit="B", unit_scale=True, desc=f"upload {dest_uri}", disable=not progress,
        file=sys.stderr, leave=True,
    )  # fmt: skip
    with bar:
        for rel, sha in sums.items():
            s3_api.put_file(
                client, folder / rel, bucket, f"{prefix}/{rel}", sha, uri=dest_uri, progress=bar.update
            )
