"""Metrics as Prometheus sees them: a real Prometheus server (Debian's `prometheus`), started with the shipped
deploy/prometheus.yml pointed at the stack served over real HTTP, answers PromQL with exactly what the test sent;
and the pieces under it: bounded labels, router decisions, the cross-process merge of snapshots.

The stack is the in-process one (tests/fixtures/served_stack.py); the Ray deployment's cluster view (ingress and
replica in different processes, merged through the catalog) is checked in tests/test_demo_reachability.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from app import metrics
from app import metrics_core as mc
from app.catalog.redis_server import free_port
from app.protocol import ReplicaStats
from app.router.routing.decisions import decision
from tests.fixtures.served_stack import ADMIN, REPLICA, ServedStack
from tests.fixtures.services import redis_server  # noqa: F401
from tests.fixtures.system_tools import ensure_tool

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------- bounded labels
def _values(family) -> set[str]:
    return {values[0] for values, _ in family.snapshot()[4]}


def test_a_million_adapters_cannot_blow_up_the_scrape():
    requests = mc.counter("t_requests", "", ["adapter"])
    top = metrics.TopK(5, on_demote=lambda v: requests.remove_where("adapter", v))
    for i in range(20_000):  # a long tail: each adapter seen once or twice
        requests.labels(top(f"tail-{i % 9000}")).inc()
    values = _values(requests)
    assert len(values) <= 6 and metrics.OTHER in values
    assert len(top.counts) <= top.capacity and len(top.labelled) == 5


def test_a_hot_adapter_gets_its_own_label_and_the_one_it_replaces_loses_its_series():
    requests = mc.counter("t_requests", "", ["adapter"])
    top = metrics.TopK(2, on_demote=lambda v: requests.remove_where("adapter", v))
    for name in ("old1", "old2"):
        requests.labels(top(name)).inc()
    assert top("cold") == metrics.OTHER  # one request does not displace anyone
    for _ in range(10):
        requests.labels(top("hot")).inc()
    assert "hot" in top.labelled and len(top.labelled) == 2
    names = _values(requests)
    assert "hot" in names and len(names - {metrics.OTHER}) == 2  # the demoted one's series is gone
    assert top("hot") == "hot"


def test_router_decisions_are_classified_from_what_the_router_knew():
    stats = ReplicaStats("r1", resident=("a@1",), loading=("b@1",), free_slots=1)
    assert decision([], stats, {}, "r1") == "base"
    assert decision(["a@1", "b@1"], stats, {}, "r1") == "held"
    assert decision(["c@1"], ReplicaStats("r1"), {"c@1": ["r1"]}, "r1") == "held"
    assert decision(["c@1"], None, {}, "r1") == "any"
    assert decision(["a@1", "c@1"], stats, {}, "r1") == "free_slot"
    assert decision(["c@1", "d@1"], stats, {}, "r1") == "any"


def test_our_text_format_parses_with_prometheus_clients_own_parser():
    """app/metrics_core.py writes the exposition itself (prometheus_client's collect costs a replica ~200 ms of
    CPU per scrape); the reference client's parser reads it back exactly: escaped labels, counters, gauges,
    cumulative histogram buckets, process labels added."""
    from prometheus_client.parser import text_string_to_metric_families

    c = mc.counter("t_requests", 'Requests with "quotes"\nand a newline', ["adapter"])
    c.labels('a\\b"c\nd').inc(3)
    g = mc.gauge("t_depth", "Queue depth")
    g.labels().set(2.5)
    h = mc.histogram("t_seconds", "Latency", ["adapter"], [0.1, 1.0])
    for v in (0.05, 0.5, 5.0):
        h.labels("x").observe(v)
    text = mc.text([({"replica": "r1"}, [c.snapshot(), g.snapshot(), h.snapshot()])])
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    [req] = fams["t_requests"].samples
    assert req.value == 3 and req.labels == {"adapter": 'a\\b"c\nd', "replica": "r1"}
    assert fams["t_requests"].documentation == 'Requests with "quotes"\nand a newline'
    assert [s.value for s in fams["t_depth"].samples] == [2.5]
    buckets = {s.labels["le"]: s.value for s in fams["t_seconds"].samples if s.name == "t_seconds_bucket"}
    assert buckets == {"0.1": 1, "1": 2, "+Inf": 3}
    count = [s.value for s in fams["t_seconds"].samples if s.name == "t_seconds_count"]
    assert count == [3]


# ---------------------------------------------------------------- the real Prometheus
@pytest.fixture(scope="module")
def stack(redis_server, llama_dir, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("metrics-adapters")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORALAND_CACHE_DIR", str(tmp_path_factory.mktemp("metrics-cache")))
        s = ServedStack(redis_server, llama_dir, root)
    yield s
    s.close()


class Prometheus:
    def __init__(self, binary: str, stack: ServedStack, tmp: Path):
        shipped = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
        (job,) = [j for j in shipped["scrape_configs"] if j["job_name"] == "loraland"]
        assert job["metrics_path"] == "/metrics" and job["authorization"]["type"] == "Bearer"
        token = tmp / "admin_token"
        token.write_text(ADMIN)
        token.chmod(0o600)
        # The shipped config, pointed at this stack and scraping every second (the test waits for scrapes).
        job["authorization"]["credentials_file"] = str(token)
        job["static_configs"][0]["targets"] = [f"127.0.0.1:{stack.port}"]
        job["scrape_interval"], job["scrape_timeout"] = "1s", "1s"
        shipped["global"]["scrape_interval"] = "1s"
        config = tmp / "prometheus.yml"
        config.write_text(yaml.safe_dump(shipped))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address={self.url[7:]}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"prometheus did not start: {(tmp / 'prometheus.log').read_text()[-2000:]}"
                )
            time.sleep(0.2)

    def query(self, promql: str, by: str | None = None) -> dict[str, float] | float:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10, trust_env=False)
        r.raise_for_status()
        result = r.json()["data"]["result"]
        if by is None:
            return float(result[0]["value"][1]) if result else 0.0
        return {row["metric"].get(by, ""): float(row["value"][1]) for row in result}

    def wait_for(self, promql: str, want: float, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        got = None
        while time.monotonic() < deadline:
            got = self.query(promql)
            if got == want:
                return
            time.sleep(0.5)
        raise AssertionError(f"{promql} = {got}, want {want} after {timeout_s}s")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    p = Prometheus(ensure_tool("prometheus", "prometheus"), stack, tmp_path_factory.mktemp("prometheus"))
    yield p
    p.close()


def test_prometheus_sees_what_was_sent_per_adapter_and_tenant(stack, prometheus):
    plan = [("alpha", "a")] * 3 + [("alpha", "b")] * 2 + [("beta", "a")] * 2 + [("beta", "b")] * 4
    sent = {"requests": {}, "prompt": {}, "completion": {}}

    def add(kind, key, value):
        sent[kind][key] = sent[kind].get(key, 0) + value

    for i, (tenant, adapter) in enumerate(plan):
        usage = stack.complete(tenant, adapter, f"hello number {i}", stream=i % 3 == 0, max_tokens=3 + i % 4)
        for key in (stack.adapters[adapter], stack.tenants[tenant]):
            add("requests", key, 1)
            add("prompt", key, usage["prompt_tokens"])
            add("completion", key, usage["completion_tokens"])
    n = len(plan)
    ours = f'adapter=~"{stack.adapters["a"]}|{stack.adapters["b"]}"'
    prometheus.wait_for(f"sum(loraland_time_to_first_token_seconds_count{{{ours}}})", n)
    prometheus.wait_for(f'sum(loraland_requests_total{{{ours},outcome="2xx"}})', n)

    def per(metric: str, by: str) -> dict[str, float]:
        return prometheus.query(f"sum by ({by}) ({metric}{{{ours}}})", by)

    adapters, tenants = set(stack.adapters.values()), set(stack.tenants.values())
    for kind, metric in (
        ("requests", "loraland_requests_total"),
        ("prompt", "loraland_prompt_tokens_total"),
        ("completion", "loraland_completion_tokens_total"),
    ):
        assert per(metric, "adapter") == {k: v for k, v in sent[kind].items() if k in adapters}, kind
        assert per(metric, "tenant") == {k: v for k, v in sent[kind].items() if k in tenants}, kind
    ttft = per("loraland_time_to_first_token_seconds_count", "adapter")
    assert ttft == {k: v for k, v in sent["requests"].items() if k in adapters}
    assert sum(ttft.values()) == n
    # The replica's side, labelled with it: KV blocks, adapters on the device, the loads with their source.
    assert prometheus.query(f'loraland_kv_blocks_total{{replica="{REPLICA}"}}') > 0
    assert prometheus.query(f'loraland_adapters_resident{{replica="{REPLICA}",tier="device"}}') == 2
    loads = prometheus.query(f"sum by (source) (loraland_adapter_loads_total{{{ours}}})", "source")
    assert loads == {"local": 2}


def test_another_process_snapshot_joins_the_same_scrape(stack, prometheus):
    """A second process (as another ingress replica on another node would) publishes its snapshot to the
    catalog; the one scrape target now serves its series too, labelled with that process."""
    a, alpha = stack.adapters["a"], stack.tenants["alpha"]
    code = (
        "from app import metrics\n"
        "from app.catalog.store import Catalog\n"
        "from app.catalog.telemetry import TelemetryBoard\n"
        "metrics.identify(ingress='second-ingress')\n"
        f"metrics.REQUESTS.labels({a!r}, {alpha!r}, '2xx').inc(7)\n"
        f"TelemetryBoard(Catalog({stack.redis_url!r}, namespace={stack.ns!r}))"
        ".publish(metrics.PROCESS, metrics.snapshot(), 120)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=120)
    prometheus.wait_for(f'sum(loraland_requests_total{{ingress="second-ingress",adapter="{a}"}})', 7)
    by_process = prometheus.query(f'sum by (ingress) (loraland_requests_total{{adapter="{a}"}})', "ingress")
    assert by_process["second-ingress"] == 7 and by_process[""] == 5  # ours has no ingress label here


def test_metrics_need_the_admin_token(stack):
    assert httpx.get(f"{stack.base}/metrics", timeout=10).status_code == 401
    tenant = {"Authorization": f"Bearer {stack.keys['alpha']}"}
    assert httpx.get(f"{stack.base}/metrics", headers=tenant, timeout=10).status_code == 403
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = httpx.get(f"{stack.base}/metrics", headers=admin, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    names = {line.split("{")[0].split(" ")[0] for line in r.text.splitlines() if line.startswith("loraland_")}
    assert {
        "loraland_requests_total",
        "loraland_time_to_first_token_seconds_bucket",
        "loraland_queue_depth",
    } <= names
    assert not any(n.endswith("_created") for n in names)


def test_metrics_can_be_switched_off():
    from app.config.metrics_config import MetricsConfig
    from app.router.http.metrics import RequestObserver, exposition

    def scrape() -> str:
        return exposition([{"labels": {}, "families": metrics.snapshot()["families"]}])

    def counted():
        return scrape().count("\n"), metrics.snapshot()["events"]

    before = counted()
    metrics.configure(MetricsConfig(enabled=False))
    try:
        obs = RequestObserver()
        obs.resolved(type("Spec", (), {"stages": ((1,),), "canonical": lambda self: "never-seen@1"})())
        obs.finish(200)
        metrics.event("error", message="x")
        assert counted() == before and "never-seen" not in scrape()
    finally:
        metrics.configure(MetricsConfig())
    with pytest.raises(ValueError, match="top_adapters"):
        MetricsConfig(top_adapters=0)
    assert MetricsConfig.from_options({"top_adapters": 3}).top_adapters == 3


def test_refusals_and_cancelled_streams_are_counted(stack):
    """A 404 counts under (none) with its tenant and shows on the status page's recent errors; a client that
    goes away mid-stream counts as cancelled."""

    def count(adapter: str, tenant: str, outcome: str) -> float:
        text = httpx.get(
            f"{stack.base}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10
        ).text
        prefix = "loraland_requests_total{"
        want = {f'adapter="{adapter}"', f'tenant="{tenant}"', f'outcome="{outcome}"'}
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(prefix) and want <= set(line[len(prefix) : line.index("}")].split(","))
        )

    alpha = stack.tenants["alpha"]
    before = count(metrics.NONE, alpha, "4xx")
    r = httpx.post(
        f"{stack.base}/v1/completions",
        json={"model": "no-such-adapter", "prompt": "x"},
        headers={"Authorization": f"Bearer {stack.keys['alpha']}"},
        timeout=30,
    )
    assert r.status_code == 404
    assert count(metrics.NONE, alpha, "4xx") == before + 1
    data = httpx.get(
        f"{stack.base}/status/data", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10
    ).json()
    assert any(e["status"] == 404 and e["tenant"] == alpha for e in data["errors"])

    a = stack.adapters["a"]
    cancelled = count(a, alpha, "cancelled")
    body = {"model": a, "prompt": "a long one", "max_tokens": 200, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {stack.keys['alpha']}"}
    with httpx.stream("POST", f"{stack.base}/v1/completions", json=body, headers=headers, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # the first token came: hang up
    deadline = time.monotonic() + 30
    while count(a, alpha, "cancelled") != cancelled + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert count(a, alpha, "cancelled") == cancelled + 1
