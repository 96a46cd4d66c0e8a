"""The boto3 calls behind the S3 source (s3.py): one cached client per S3Settings, listing, download with
hashing (under a byte Budget that parallel downloads share), upload (multipart when large), and the one place
boto3 failures become AdapterUnavailable with a message saying what to check.

Endpoint, region and credentials come from S3Settings (app/config/settings.py, read from AWS_*); what it leaves
unset is left to boto3's own chain (profiles, instance roles), so MinIO, R2 or moto need no setting of ours."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.config.settings import S3Settings
from app.errors import AdapterUnavailable, InvalidAdapter, InvalidRequest
from app.files import safe_relpath

MULTIPART_THRESHOLD = 64 << 20  # bytes; S3 needs parts of at least 5 MiB
MULTIPART_CHUNK = 64 << 20
_CHUNK = 1 << 20


@dataclass(frozen=True)
class S3Object:
    key: str
    rel: str  # path under the prefix: the adapter's file name
    size: int
    etag: str


_loader: Any = None
_clients: dict[S3Settings, Any] = {}
_clients_lock = threading.Lock()


def client(settings: S3Settings) -> Any:
    """The S3 client for these settings: one per distinct value, so a cold adapter fetch does not pay for
    building a client (20-250 ms on a busy replica). botocore clients are thread-safe; refreshable credentials
    refresh themselves."""
    with _clients_lock:
        c = _clients.get(settings)
        if c is None:
            c = _clients[settings] = _new_client(settings)
    return c


def _new_client(settings: S3Settings) -> Any:
    global _loader
    import boto3
    import botocore.loaders
    import botocore.session
    from botocore.config import Config

    if _loader is None:  # the parsed service model (most of a client's cost) is shared
        _loader = botocore.loaders.create_loader()
    core = botocore.session.Session()
    core.register_component("data_loader", _loader)
    for var, value in (
        ("config_file", settings.config_file),
        ("credentials_file", settings.credentials_file),
    ):
        if value:
            core.set_config_variable(var, value)
    # Keys only as a pair: a lone half is left to boto3's chain, which reports it as boto3 always has.
    keys = bool(settings.access_key_id and settings.secret_access_key)
    session = boto3.session.Session(
        botocore_session=core,
        aws_access_key_id=settings.access_key_id if keys else None,
        aws_secret_access_key=settings.secret_access_key if keys else None,
        aws_session_token=settings.session_token if keys else None,
        region_name=settings.region,
        profile_name=settings.profile,
    )
    # Path-style with a configured endpoint: the bucket goes in the path, so every request goes to exactly that
    # host (virtual-hosted style would send it to <bucket>.<endpoint host>). botocore never follows an HTTP
    # redirect's Location; its S3 region redirect re-resolves the same endpoint with another signing region.
    s3_cfg = {"addressing_style": "path"} if settings.endpoint_url else None
    # Response checksums only when a download asks for them (download's `checksum`): a fetch the catalog
    # describes checks each file's sha256 as it arrives, and a CRC over the same bytes would be a second pass.
    cfg = Config(
        retries={"max_attempts": 3, "mode": "standard"},
        connect_timeout=5,
        read_timeout=60,
        s3=s3_cfg,
        max_pool_connections=16,
        response_checksum_validation="when_required",
    )
    return session.client("s3", endpoint_url=settings.endpoint_url, config=cfg)


def unavailable(exc: Exception, uri: str, what: str = "") -> AdapterUnavailable:
    """A clear AdapterUnavailable for a boto3/botocore exception about `uri` (`what`: the object, if any)."""
    from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError, NoCredentialsError

    target = f"{uri} ({what})" if what else uri
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        bucket = uri[5:].split("/", 1)[0]
        if code == "NoSuchBucket":
            msg = (
                f"{target}: no such bucket {bucket!r}: check the bucket name, the region and AWS_ENDPOINT_URL"
            )
        elif code in ("NoSuchKey", "404", "NotFound") or status == 404:
            msg = (
                f"{uri}: no such key {what or '(the prefix)'}: the object is missing; push the adapter again"
            )
        elif (
            code in ("AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch")
            or status == 403
        ):
            msg = f"{target}: access denied ({code}): check the AWS credentials and the bucket's policy"
        else:
            msg = f"{target}: S3 error {code or status}: {err.get('Message', exc)}"
    elif isinstance(exc, NoCredentialsError):
        msg = (
            f"{target}: no AWS credentials found: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
        )
    elif isinstance(exc, EndpointConnectionError):
        msg = f"{target}: cannot reach the S3 endpoint ({exc}): check AWS_ENDPOINT_URL and the network"
    elif isinstance(exc, BotoCoreError):
        msg = f"{target}: S3 request failed ({exc})"
    else:
        msg = f"{target}: S3 request failed ({type(exc).__name__}: {exc})"
    return AdapterUnavailable(msg)


def list_objects(s3: Any, bucket: str, prefix: str, uri: str) -> dict[str, S3Object]:
    """Objects under prefix/, keyed by their path under it; keys that would escape the folder are refused."""
    out: dict[str, S3Object] = {}
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix) + 1 :]
                if not rel or rel.endswith("/"):  # "folder" marker objects
                    continue
                safe_relpath(rel, where=f"s3://{bucket}/{obj['Key']}", error=InvalidAdapter)
                out[rel] = S3Object(obj["Key"], rel, int(obj["Size"]), str(obj.get("ETag", "")).strip('"'))
    except (InvalidAdapter, InvalidRequest):
        raise
    except Exception as e:
        raise unavailable(e, uri) from None
    return out


class Budget:
    """The bytes an adapter's downloads may still write (its `cap`), shared by downloads running at once."""

    def __init__(self, cap: int) -> None:
        self.cap, self.left = cap, cap
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        """Spend n bytes; False (nothing spent) when fewer are left."""
        with self._lock:
            if n > self.left:
                return False
            self.left -= n
            return True

    def used(self) -> int:
        return self.cap - self.left


def download(
    s3: Any,
    bucket: str,
    key: str,
    dest: Path,
    *,
    budget: Budget,
    uri: str,
    progress: Callable[[int], None] | None = None,
    checksum: bool = True,
) -> tuple[str, int, str]:
    """Stream one object to dest, hashing as it goes; refuses to write more than what is left of `budget` (the
    adapter's cap, shared with the adapter's other files); `progress(n)` after each chunk of n bytes.
    `checksum`: have botocore check S3's own response checksum too (a caller that checks the sha256 against
    a recorded one passes False). -> (sha256, bytes, etag)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    h, n, cap = hashlib.sha256(), 0, budget.cap
    try:
        obj = s3.get_object(Bucket=bucket, Key=key, **({"ChecksumMode": "ENABLED"} if checksum else {}))
        if int(obj.get("ContentLength") or 0) > budget.left:
            raise InvalidAdapter(
                f"{uri}: adapter is over the {cap}-byte limit (LORALAND_MAX_ADAPTER_BYTES) with {key} "
                f"({obj['ContentLength']} bytes): refusing to download it"
            )
        body = obj["Body"]
        with open(dest, "wb") as f:
            while chunk := body.read(_CHUNK):
                n += len(chunk)
                if not budget.take(len(chunk)):
                    raise InvalidAdapter(
                        f"{uri}: adapter is over the {cap}-byte limit (LORALAND_MAX_ADAPTER_BYTES) with {key}: "
                        "refusing to download it"
                    )
                h.update(chunk)
                f.write(chunk)
                if progress is not None:
                    progress(len(chunk))
    except InvalidAdapter:
        raise
    except Exception as e:
        raise unavailable(e, uri, key) from None
    return h.hexdigest(), n, str(obj.get("ETag", "")).strip('"')


def stored_sha256(s3: Any, bucket: str, key: str, uri: str) -> str | None:
    """The sha256 we recorded in an object's metadata at upload; '' if it exists without one; None if absent."""
    from botocore.exceptions import ClientError

    try:
        head = s3.head_object(Bucket=bucket, Key=key)
    except ClientError as e:
        if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
            return None
        raise unavailable(e, uri, key) from None
    except Exception as e:
        raise unavailable(e, uri, key) from None
    return head.get("Metadata", {}).get("sha256", "")


def put_file(
    s3: Any,
    path: Path,
    bucket: str,
    key: str,
    sha256: str,
    *,
    uri: str,
    progress: Callable[[int], None] | None,
) -> None:
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_CHUNK)
    try:
        s3.upload_file(
            str(path), bucket, key, Config=cfg, Callback=progress, ExtraArgs={"Metadata": {"sha256": sha256}}
        )
    except Exception as e:
        # boto3 wraps the ClientError in S3UploadFailedError (as its __context__): report the real cause.
        cause = e.__cause__ or e.__context__
        raise unavailable(cause if isinstance(cause, Exception) else e, uri, key) from None
