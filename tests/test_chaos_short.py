"""A short chaos run (load_tests/chaos.py) in the suite: a real Ray cluster with 2 replicas, real Redis, moto's S3
server, a mixed load over 8 adapters, chains and merges, streaming and not, with client disconnects, while each
fault is injected once: kill -9 of a replica worker, Redis killed and restarted, S3 stopped and started, kill -9
of the ingress replica. Every 200 must be the single-request greedy reference (wrong = 0), and every adapter must
serve again within 30 s of each fault's end. Requests lost are asserted per fault (see LOST_XFAIL).

Needs a loopback-only network namespace (Ray probes the network): skipped elsewhere."""

from __future__ import annotations

import pytest

from load_tests.chaos import FAULTS, ChaosConfig, run_chaos, table
from load_tests.local_stack import LocalStack, StackConfig, in_offline_namespace

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

# Faults that still lose requests (no answer or a 5xx without a message), with where the fix belongs; the
# assertion for the others is that nothing is lost.
LOST_XFAIL: dict[str, str] = {
    # Measured: requests the killed ingress held die with it (a stream cut without [DONE]), and until Serve has
    # a new ingress its proxy answers 500 text/plain "Internal Server Error" (not OpenAI-shaped, not retryable
    # by its status). Needs ingress_replicas >= 2 (app/config/app_config.py, one ingress by default) so the
    # proxy has another to route to, and a clean 503 + Retry-After while none is up.
    "ingress": "the only ingress replica killed: its in-flight requests and the proxy's 500s until it is back",
}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    if not in_offline_namespace():
        pytest.skip("needs a loopback-only network namespace: ../shared/tools/offline pytest ...")
    cfg = ChaosConfig(concurrency=4, pre_s=2.0, down_s=3.0, post_s=5.0, recovery_timeout_s=90.0)
    with LocalStack(StackConfig(adapters=8, cold=2), workdir=tmp_path_factory.mktemp("chaos")) as stack:
        out = run_chaos(stack, cfg)
    print("\n" + table(out))
    return {r.fault: r for r in out}


@pytest.mark.parametrize("fault", FAULTS)
def test_no_wrong_answers_and_recovery_within_30s(rows, fault):
    row = rows[fault]
    assert row.sent > 0 and row.ok > 0, table([row])
    assert row.wrong == 0, table([row])
    assert row.recovery_s is not None and row.recovery_s < 30.0, table([row])


@pytest.mark.parametrize("fault", FAULTS)
def test_nothing_lost(rows, fault):
    row = rows[fault]
    if row.lost and fault in LOST_XFAIL:
        pytest.xfail(f"{fault}: {row.lost} lost ({LOST_XFAIL[fault]})")
    assert row.lost == 0, table([row])
