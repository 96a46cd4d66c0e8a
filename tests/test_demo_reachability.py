"""The demo's stack is reachable from the host and sends nothing off the machine.

`loraland demo` used to run in a private network namespace (Ray probes cloud metadata addresses on its own), so
its printed commands failed from any other terminal. Now it runs in the host's namespace with those probes
switched off by configuration (app/cli/local_only.py). Here the demo's own stack-starting code (on the tiny
model, so no training) runs in the host's network namespace under `strace -f`, which records every connect()
and sendto() of every process it starts (Ray's raylet, GCS, dashboard, agents, workers); then:
- curl, run in the host's namespace as a person's second terminal would, lists the models, registers an
  adapter, completes with it, and reads /metrics and /status;
- /metrics holds series from both Serve processes, the ingress's and the replica's, each labelled with its own
  process (the cluster view merged through the catalog, on a real Ray deployment);
- the trace holds no connect() or sendto() to an address that is not loopback.

From inside `./run test`'s loopback-only namespace the test enters the namespace `./run test` was started from
(its nearest ancestor process outside it) with nsenter (root): that is the namespace the proof is about.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app.cli.local_only import LOCAL_ONLY_ENV
from tests.fixtures.system_tools import ensure_tool
from tests.fixtures.tiny_adapter import write_tiny_adapter

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

DRIVER = """
import os, signal, sys, threading
from contextlib import ExitStack
from pathlib import Path
from app.cli.demo import start_stack

stop = threading.Event()
with ExitStack() as stack:
    base = start_stack(stack, Path(sys.argv[1]), None, "127.0.0.1", int(sys.argv[2]))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print("READY", os.getpid(), base, flush=True)
    stop.wait()
print("STOPPED", flush=True)
"""

_ADDR = re.compile(r'(?:inet_addr\("([^"]+)"\)|inet_pton\(AF_INET6, "([^"]+)")')


def off_machine(strace_log: str) -> list[str]:
    """The traced connect()/sendto() lines whose address is not loopback (nor the unspecified address, which
    also means this host)."""
    bad = []
    for line in strace_log.splitlines():
        if ("connect(" not in line and "sendto(" not in line) or "AF_INET" not in line:
            continue
        for v4, v6 in _ADDR.findall(line):
            ip = ipaddress.ip_address(v4 or v6)
            mapped = getattr(ip, "ipv4_mapped", None)
            ip = mapped or ip
            if not (ip.is_loopback or ip.is_unspecified):
                bad.append(line.strip())
    return bad


def test_the_parser_flags_what_it_should():
    log = "\n".join(
        [
            '12 connect(3, {sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("10.255.255.53")}, 16) = 0',
            '12 connect(3, {sa_family=AF_INET, sin_port=htons(80), sin_addr=inet_addr("169.254.169.254")}, 16)',
            '12 connect(4, {sa_family=AF_INET6, sin6_port=htons(53), inet_pton(AF_INET6, "2001:4860:4860::8888", '
            "&sin6_addr), sin6_scope_id=0}, 28) = -1",
            '12 connect(5, {sa_family=AF_INET, sin_port=htons(6379), sin_addr=inet_addr("127.0.0.1")}, 16) = 0',
            '12 connect(6, {sa_family=AF_INET6, sin6_port=htons(1), inet_pton(AF_INET6, "::ffff:127.0.0.1", '
            "&sin6_addr)}, 28) = 0",
            '12 connect(7, {sa_family=AF_UNIX, sun_path="/tmp/ray/x"}, 110) = 0',
            '12 sendto(8, "x", 1, 0, {sa_family=AF_INET, sin_port=htons(53), sin_addr=inet_addr("8.8.8.8")}, 16)',
        ]
    )
    assert [re.search(r'"([0-9a-f.:]+)"', b).group(1) for b in off_machine(log)] == [
        "10.255.255.53",
        "169.254.169.254",
        "2001:4860:4860::8888",
        "8.8.8.8",
    ]


def _ancestors() -> list[int]:
    pids, pid = [], os.getpid()
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            break
        pids.append(pid)
    return pids


def _host_net() -> list[str]:
    """The prefix that runs a command in the host's network namespace: empty when we are in it; else nsenter into
    the namespace of the nearest ancestor process outside ours (the shell `./run test` was started from)."""
    ours = os.stat("/proc/self/ns/net").st_ino
    for pid in _ancestors():
        try:
            theirs = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            continue
        if theirs != ours:
            if os.geteuid() != 0 or not shutil.which("nsenter"):
                pytest.skip(
                    "running in a private network namespace; entering the host's needs root and nsenter"
                )
            return ["nsenter", f"--net=/proc/{pid}/ns/net"]
    return []


class Stack:
    """The driver above under strace, in the host's network namespace."""

    def __init__(self, net: list[str], strace: str, assets: Path, port: int, log: Path, env: dict):
        self.net, self.log = net, log
        cmd = [*net, strace, "-f", "--seccomp-bpf", "-qq", "-e", "trace=connect,sendto", "-o", str(log)]
        cmd += [sys.executable, "-c", DRIVER, str(assets), str(port)]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(420) or self.proc.poll() is not None:
            self.stop()
            raise AssertionError("the demo stack did not start:\n" + "\n".join(self.lines[-60:]))
        _, pid, self.base = next(x for x in self.lines if x.startswith("READY")).split()
        self.pid = int(pid)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if line.startswith("READY"):
                self.ready.set()

    def curl(self, path: str, *args: str) -> tuple[int, str]:
        """curl in the host's namespace: what a person's second terminal runs."""
        out = subprocess.run(
            [*self.net, "curl", "-s", "-m", "120", "-w", "\n%{http_code}", *args, f"{self.base}{path}"],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        body, _, code = out.stdout.rpartition("\n")
        return int(code or 0), body

    def stop(self) -> None:
        if self.proc.poll() is None:
            if hasattr(self, "pid"):
                os.kill(self.pid, signal.SIGINT)  # the driver unwinds: Serve, Ray and Redis stop
            try:
                self.proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                os.killpg(
                    self.proc.pid, signal.SIGKILL
                )  # our session: strace, the driver and what it started
                self.proc.wait(timeout=30)


def test_demo_stack_is_reachable_from_the_host_and_stays_on_the_machine(tiny_models, tmp_path):
    net = _host_net()
    strace = ensure_tool("strace", "strace")
    ensure_tool("curl", "curl")
    assets = tmp_path / "assets"
    (assets / "adapters").mkdir(parents=True)
    (assets / "base").symlink_to(tiny_models["llama-gqa"])
    write_tiny_adapter(assets / "adapters" / "ad1", seed=11)
    # The variables the demo sets itself are taken out: the test proves the code sets them, not the caller.
    env = {k: v for k, v in os.environ.items() if k not in LOCAL_ONLY_ENV and not k.startswith("AWS_")}
    env.update(PYTHONPATH=str(ROOT), LORALAND_CACHE_DIR=str(tmp_path / "cache"))
    log = tmp_path / "strace.log"
    # A port free in the namespace the stack runs in (ours may be another one).
    pick = "from app.catalog.redis_server import free_port; print(free_port())"
    port = int(subprocess.check_output([*net, sys.executable, "-c", pick], cwd=ROOT, env=env, timeout=60))
    stack = Stack(net, strace, assets, port, log, env)
    try:
        code, body = stack.curl("/v1/models")
        assert code == 200 and "demo" in body, body
        code, body = stack.curl(
            "/v1/adapters", "-H", "Content-Type: application/json", "-d", '{"name": "ad1", "public": true}'
        )
        assert code == 201, body
        request = {"model": "ad1", "prompt": "hello lora land", "max_tokens": 4}
        code, body = stack.curl(
            "/v1/completions", "-H", "Content-Type: application/json", "-d", json.dumps(request)
        )
        assert code == 200 and json.loads(body)["usage"]["completion_tokens"] > 0, body
        # /metrics: the ingress's series and the replica's, from two processes, in one scrape.
        deadline, text = time.monotonic() + 60, ""
        while time.monotonic() < deadline:
            code, text = stack.curl("/metrics")
            ingress = re.search(r'^loraland_requests_total\{[^}]*ingress="[^"]+"', text, re.M)
            replica = re.search(r'^loraland_kv_blocks_total\{[^}]*replica="[^"]+"', text, re.M)
            loads = re.search(r'^loraland_adapter_loads_total\{[^}]*adapter="ad1"[^}]*replica="', text, re.M)
            if code == 200 and ingress and replica and loads:
                break
            time.sleep(1)
        else:
            raise AssertionError(f"/metrics lacks a process's series:\n{text[-3000:]}")
        code, page = stack.curl("/status")
        assert code == 200 and "<title>LoRA-Land status</title>" in page
        code, data = stack.curl("/status/data")
        assert code == 200 and len(json.loads(data)["replicas"]) == 1
    finally:
        stack.stop()
    assert any(line.startswith("STOPPED") for line in stack.lines), "\n".join(stack.lines[-40:])
    trace = log.read_text()
    assert "connect(" in trace  # the trace saw the stack's own loopback traffic
    bad = off_machine(trace)
    assert not bad, "connections off the machine:\n" + "\n".join(bad[:30])
