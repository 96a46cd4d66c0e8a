"""Keep a local stack's traffic on the machine, by configuration: what Ray and the libraries under it would
otherwise send off the machine when a stack starts, each switched off where it is decided.

Found by running the stack under `strace -f -e trace=connect,sendto,sendmsg` (tests/test_demo_reachability.py
does it on every run and fails on any connect to a non-loopback address):
- Ray's dashboard process (started even with include_dashboard=False, for usage stats alone) posts a usage
  report to usage-stats.ray.io: RAY_USAGE_STATS_ENABLED=0. Before it even reads that switch (Ray 2.60,
  UsageStatsHead.run -> usage_lib.get_cluster_config_to_report), it detects the cloud by HTTP (`requests`) to
  169.254.169.254 (Azure, AWS) and metadata.google.internal (a DNS query first), unless ~/ray_bootstrap_config.yaml
  names the provider. No switch turns that off, so Python's HTTP clients get a proxy that is a closed loopback
  port (HTTP_PROXY/HTTPS_PROXY=http://127.0.0.1:9, loopback exempt through NO_PROXY): the probe fails at once,
  on the machine, with no DNS query. Only the upper-case names are set: gRPC (Ray's own transport) reads the
  lower-case ones, and a proxy the caller set is kept.
- Ray finds the node's IP by a UDP connect to 8.8.8.8:53 (then [2001:4860:4860::8888]:53), and then runs the
  whole cluster on that address: even ray.init(_node_ip_address="127.0.0.1") is turned into it ("a remotely
  reachable IP"). RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is Ray's switch for a single-node, loopback-only cluster
  (its default on Windows and macOS): the node IP is 127.0.0.1 and the probe is skipped. A local stack is one
  node; `loraland serve` for a multi-node cluster must not set it.
- The Hugging Face libraries look models up on the Hub and send telemetry: HF_HUB_OFFLINE=1 and
  HF_HUB_DISABLE_TELEMETRY=1 (the demo's model is a local folder).
- boto3 asks the EC2 instance-metadata service (169.254.169.254) for credentials when it has none:
  AWS_EC2_METADATA_DISABLED=true.
"""

from __future__ import annotations

import os
import sys

LOCAL_ONLY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "HTTP_PROXY": "http://127.0.0.1:9",
    "HTTPS_PROXY": "http://127.0.0.1:9",
    "NO_PROXY": "localhost,127.0.0.1,::1",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
LOOPBACK_IP = "127.0.0.1"


def local_only() -> dict[str, str]:
    """Set LOCAL_ONLY_ENV in this process's environment, where Ray's processes (started by ray.init, which copy
    it) and this process's libraries read them; a value the caller already set is kept. Call it before Ray is
    imported: Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, at import (a RuntimeError says so otherwise).
    Returns the ray.init keyword arguments that keep Ray itself on loopback."""
    for key, value in LOCAL_ONLY_ENV.items():
        os.environ.setdefault(key, value)  # handing the environment on to child processes
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and getattr(constants, "ENABLE_RAY_CLUSTER", False):
        raise RuntimeError(
            "Ray was imported before local_only(): it would run on the machine's network address and probe "
            "8.8.8.8 to find it; call local_only() before importing ray"
        )
    return {"_node_ip_address": LOOPBACK_IP}
