"""Where an adapter URI can make the server go (issue 16, security).

- s3:// reaches the configured S3 endpoint only: a URI names a bucket, never a host. ARNs, access-point aliases,
  directory buckets and IP-shaped names are refused before any request (botocore would route them to other
  hosts); with an endpoint configured every request goes to exactly that host and port, path-style; an
  endpoint's 3xx answers are not followed anywhere else.
- hf:// reaches the configured Hub endpoint only, whatever the repo or revision text holds.
- Local folders named over HTTP stay under the configured roots: '..', symlinked folders and files leaving the
  root, and symlink loops are refused with a 400 (a loop used to escape as a RuntimeError: a 500).

Servers are real (http.server on loopback) and record every request; nothing here leaves 127.0.0.1. Error
messages that could name another tenant's adapters, and throttling of bad API keys, are in
tests/test_tenant_leaks.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from app.catalog.sources import AdapterHub, s3_api
from app.catalog.sources.s3 import parse_s3_uri
from app.config.settings import S3Settings, Settings
from app.errors import AdapterUnavailable, InvalidRequest, LoraLandError
from tests.fixtures.tiny_adapter import write_tiny_adapter

ROOT = Path(__file__).resolve().parents[1]

NO_SUCH_KEY = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchKey</Code>'
    b"<Message>The specified key does not exist.</Message></Error>"
)


class Recorder:
    """An HTTP server on 127.0.0.1 that records (method, path, Host) and answers as `mode` says."""

    def __init__(self) -> None:
        self.hits: list[tuple[str, str, str]] = []
        self.mode, self.redirect_to = "404", ""
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                recorder.hits.append((self.command, self.path, self.headers.get("Host", "")))
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)
                body, headers = NO_SUCH_KEY, {"Content-Type": "application/xml"}
                status = 404
                if recorder.mode in ("301", "302", "307"):
                    status = int(recorder.mode)
                    headers["Location"] = f"{recorder.redirect_to}{self.path}"
                    if status == 301:  # S3's wrong-region answer: botocore's region redirector reads these
                        host = recorder.redirect_to.split("://", 1)[1]
                        body = (
                            "<Error><Code>PermanentRedirect</Code><Message>use this endpoint</Message>"
                            f"<Endpoint>{host}</Endpoint><Bucket>b</Bucket></Error>"
                        ).encode()
                        headers["x-amz-bucket-region"] = "eu-west-1"
                elif recorder.mode == "hf404":
                    body, headers = b'{"error": "Repository not found"}', {"Content-Type": "application/json"}
                    headers["X-Error-Code"] = "RepoNotFound"
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_HEAD = do_PUT = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint():
    r = Recorder()
    yield r
    r.close()


@pytest.fixture
def elsewhere():
    r = Recorder()
    yield r
    r.close()


def s3_settings(endpoint_url: str | None, config_file: str = "/nonexistent/aws-config") -> S3Settings:
    return S3Settings(
        endpoint_url=endpoint_url,
        region="us-east-1",
        access_key_id="testing",
        secret_access_key="testing",
        config_file=config_file,
        credentials_file="/nonexistent/aws-credentials",
    )


def hub_for(tmp_path: Path, endpoint_url: str | None, **kw) -> AdapterHub:
    return AdapterHub(settings=Settings(cache_dir=tmp_path / "cache", s3=s3_settings(endpoint_url, **kw)))


# ---------------------------------------------------------------------------------------------- s3://

HOSTILE_BUCKETS = [
    "arn:aws:s3:us-east-1:123456789012:accesspoint:myap",  # botocore: myap-123456789012.<endpoint host>
    "arn:aws:s3:us-west-2:123456789012:accesspoint",  # ...accesspoint/myap: the '/' splits it from the prefix
    "arn:aws:s3-object-lambda:us-east-1:123456789012:accesspoint:olap",
    "arn:aws:s3-outposts:us-east-1:123456789012:outpost:op-01234567890123456:accesspoint:ap",
    "myap-hrzrlukc5m36ft7okagglf3gmwluquse1b-s3alias",  # an access-point alias
    "mybucket--use1-az4--x-s3",  # S3 Express: a zonal endpoint
    "mfzwi23gnjvgw.mrap",  # a multi-region access point
    "ap--ol-s3",
    "169.254.169.254",
    "127.0.0.1",
    "Evil",
    "a..b",
    "-ab",
    "ab",
    "a" * 64,
    "xn--bcher-kva",
    "evil.example:8080",
    "user@evil.example",
    "evil.example#",
    "b_c",
]


@pytest.mark.parametrize("bucket", HOSTILE_BUCKETS)
def test_s3_uris_that_could_pick_a_host_are_refused_before_any_request(tmp_path, endpoint, bucket):
    uri = f"s3://{bucket}/adapters/x"
    with pytest.raises(InvalidRequest) as err:
        parse_s3_uri(uri)
    assert "bucket" in str(err.value)
    with pytest.raises(InvalidRequest):
        hub_for(tmp_path, endpoint.url).fetch(uri, untrusted=True)
    with pytest.raises(InvalidRequest):
        hub_for(tmp_path, endpoint.url).fetch(uri, files={"adapter_config.json": "0" * 64})
    assert endpoint.hits == []


@pytest.mark.parametrize("bucket", ["plain", "with.dots.in.it", "with-dash-123", "a1b"])
def test_every_s3_request_goes_to_the_configured_endpoint_path_style(tmp_path, endpoint, bucket):
    # A host name, not an IP, and an AWS config file asking for virtual-hosted style (<bucket>.localhost):
    # with an endpoint configured, requests stay path-style on exactly that host.
    config = tmp_path / "aws-config"
    config.write_text("[default]\ns3 =\n    addressing_style = virtual\n")
    hub = hub_for(tmp_path, f"http://localhost:{endpoint.port}", config_file=str(config))
    for files in (None, {"adapter_config.json": "0" * 64}):
        with pytest.raises(AdapterUnavailable):
            hub.fetch(f"s3://{bucket}/adapters/x", files=files)
    assert endpoint.hits, "no request reached the configured endpoint"
    for method, path, host in endpoint.hits:
        assert host == f"localhost:{endpoint.port}", (method, path, host)
        assert path.startswith(f"/{bucket}/") or path.startswith(f"/{bucket}?"), path


def test_without_an_endpoint_requests_go_to_aws_s3_only(tmp_path):
    """No endpoint configured: boto3's AWS endpoints, virtual-hosted; a valid bucket name cannot leave
    *.amazonaws.com. Requests are answered in-process (botocore's before-send), nothing is sent."""
    from botocore.awsrequest import AWSResponse

    class Raw:
        def stream(self, **_):
            yield NO_SUCH_KEY

    urls: list[str] = []

    def answer(request, **_):
        urls.append(request.url)
        return AWSResponse(request.url, 404, {"Content-Type": "application/xml"}, Raw())

    settings = s3_settings(None)
    client = s3_api.client(settings)
    client.meta.events.register_first("before-send.s3", answer)
    try:
        hub = AdapterHub(settings=Settings(cache_dir=tmp_path / "cache", s3=settings))
        for bucket in ("plain", "with.dots", "with-dash-1"):
            with pytest.raises(AdapterUnavailable):
                hub.fetch(f"s3://{bucket}/adapters/x")
    finally:
        client.meta.events.unregister("before-send.s3", answer)
    assert len(urls) >= 3
    from urllib.parse import urlsplit

    for url in urls:
        assert urlsplit(url).hostname.endswith(".amazonaws.com"), url


@pytest.mark.parametrize("status", ["301", "302", "307"])
def test_an_endpoint_redirect_is_not_followed_elsewhere(tmp_path, endpoint, elsewhere, status):
    endpoint.mode, endpoint.redirect_to = status, elsewhere.url
    hub = hub_for(tmp_path, endpoint.url)
    for files in (None, {"adapter_config.json": "0" * 64}):
        with pytest.raises(AdapterUnavailable):
            hub.fetch("s3://plain/adapters/x", files=files)
    assert endpoint.hits
    assert elsewhere.hits == []


# ---------------------------------------------------------------------------------------------- hf://

_HF_SCRIPT = r"""
import json, socket, sys
seen = []
real_connect = socket.socket.connect
def connect(self, address):
    seen.append(list(address[:2]) if isinstance(address, tuple) else [str(address), 0])
    return real_connect(self, address)
socket.socket.connect = connect
real_gai = socket.getaddrinfo
def gai(host, *a, **k):
    seen.append([str(host), -1])
    return real_gai(host, *a, **k)
socket.getaddrinfo = gai
from app.catalog.sources import hf
from app.errors import LoraLandError
out = {}
for uri in json.loads(sys.argv[1]):
    try:
        hf.fetch(uri, None, max_bytes=1 << 20)
        out[uri] = "fetched"
    except LoraLandError as e:
        out[uri] = type(e).__name__
    except Exception as e:
        out[uri] = "CRASH " + type(e).__name__ + ": " + str(e)[:200]
print(json.dumps({"results": out, "seen": seen}))
"""

HOSTILE_HF = [
    "hf://evil.example/x",
    "hf://org/name@http://evil.example/",
    "hf://org/name@../../../../evil",
    "hf://user@evil.example/x",
    "hf://org/name@%2F%2Fevil.example",
    "hf://org/name@refs/pr/1",
]


def test_hf_uris_reach_the_configured_hub_only(tmp_path, endpoint):
    endpoint.mode = "hf404"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(
        HF_ENDPOINT=endpoint.url,
        HF_HUB_OFFLINE="0",
        HF_HUB_CACHE=str(tmp_path / "hf"),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_ETAG_TIMEOUT="5",
        PYTHONPATH=str(ROOT),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _HF_SCRIPT, json.dumps(HOSTILE_HF)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for uri, outcome in report["results"].items():
        assert outcome in ("HubMissing", "AdapterUnavailable", "InvalidRequest"), (uri, outcome)
    assert endpoint.hits, "no request reached the configured Hub endpoint"
    for host, port in report["seen"]:
        assert host == "127.0.0.1" and port in (endpoint.port, -1), report["seen"]
    for _method, path, _ in endpoint.hits:
        assert path.startswith(("/api/models/", "/org/name/", "/user/")), path


# ---------------------------------------------------------------------------------------------- local roots


@pytest.fixture
def roots(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    write_tiny_adapter(root / "good", seed=1)
    write_tiny_adapter(outside / "secret", seed=2)
    return root, outside


def local_hub(tmp_path: Path, *roots: Path) -> AdapterHub:
    return AdapterHub(
        settings=Settings(cache_dir=tmp_path / "cache", allowed_local_roots=roots, s3=s3_settings(None))
    )


def test_local_folders_over_http_stay_under_the_roots(tmp_path, roots):
    root, outside = roots
    hub = local_hub(tmp_path, root)
    assert hub.fetch(str(root / "good"), untrusted=True) == (root / "good").resolve()
    assert hub.fetch(f"file://{root / 'good'}", untrusted=True) == (root / "good").resolve()
    (root / "inner-link").symlink_to(root / "good")  # a link that stays inside is fine
    hub.fetch(str(root / "inner-link"), untrusted=True)

    (root / "escape").symlink_to(outside / "secret")
    mixed = root / "mixed"
    write_tiny_adapter(mixed, seed=3)
    (mixed / "adapter_model.safetensors").unlink()
    (mixed / "adapter_model.safetensors").symlink_to(outside / "secret" / "adapter_model.safetensors")
    nested = root / "nested"
    write_tiny_adapter(nested, seed=4)
    (nested / "sub").symlink_to(outside)
    loop = root / "loop"
    write_tiny_adapter(loop, seed=5)
    (loop / "a").symlink_to(loop / "b")
    (loop / "b").symlink_to(loop / "a")
    for uri in [
        str(outside / "secret"),
        f"{root}/../outside/secret",
        f"file://{outside / 'secret'}",
        f"file://localhost{outside / 'secret'}",
        str(root / "escape"),
        str(mixed),
        str(nested),
        str(loop),
        str(root / "loop" / "a"),
        "/",
        "~",
    ]:
        with pytest.raises(InvalidRequest) as err:
            hub.fetch(uri, untrusted=True)
        assert "refused" in str(err.value) or "outside the allowed roots" in str(err.value), uri

    with pytest.raises(InvalidRequest, match="none: set LORALAND_LOCAL_ROOTS"):
        local_hub(tmp_path).fetch(str(root / "good"), untrusted=True)
    # A missing folder under a root is unavailable, not refused; outside the roots nothing is said about it.
    with pytest.raises(AdapterUnavailable):
        hub.fetch(str(root / "missing"), untrusted=True)
    with pytest.raises(InvalidRequest):
        hub.fetch(str(outside / "missing"), untrusted=True)
    # The admin's own sources (the CLI, catalog records) are trusted: any folder.
    assert hub.fetch(str(outside / "secret")) == outside / "secret"


def test_source_errors_are_library_errors_for_odd_uris(tmp_path, roots):
    """Whatever the text, a source is a LoraLandError (a 4xx/503 over HTTP), never a crash."""
    root, _ = roots
    hub = local_hub(tmp_path, root)
    odd = ["", "s3://", "s3:///x", "s3://b", "s3://plain/", "s3://plain/../x", "s3://plain/a\\b", "hf://",
           "hf://../x", "hf://a/b/c", "ftp://x/y", "http://127.0.0.1/x", "file://", "\x00", "s3://plain/a\x00",
           f"{root}/\x00", "~nobody-such-user/x", "a" * 5000]  # fmt: skip
    for uri in odd:
        try:
            hub.fetch(uri, untrusted=True)
        except LoraLandError:
            continue
        except Exception as e:  # pragma: no cover - the failure message is the point
            pytest.fail(f"{uri!r}: {type(e).__name__}: {e}")
