"""`ray up` for real on this machine (three loopback "hosts" over SSH), `serve deploy`, one checked
request, `ray down`; every step timed.
Run: ./run bench ray_up_local [--help]. Method and results: load_tests/chaos/RESULTS.md."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
RUN = Path("/tmp/loraland-ray-up")  # fixed: deploy/cluster-local.yaml names paths in it
CONFIG = REPO / "deploy" / "cluster-local.yaml"
LOG = REPO / "load_tests" / "chaos" / "results" / "ray_up_local.log"
VENV_BIN = Path(sys.executable).parent
ADMIN = "ray-up-admin"
BUCKET = "loraland-ray-up"
ADAPTERS = ("ad0", "ad1")
NODES = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


class Log:
    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.lines: list[str] = []
        self.timings: dict[str, float] = {}

    def __call__(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:7.1f}s] {msg}"
        self.lines.append(line)
        print(line, flush=True)

    def step(self, name: str, t: float) -> None:
        self.timings[name] = round(time.monotonic() - t, 1)
        self(f"{name}: {self.timings[name]}s")

    def save(self) -> None:
        LOG.parent.mkdir(parents=True, exist_ok=True)
        LOG.write_text(
            "\n".join(self.lines) + "\n" + json.dumps({"timings_s": self.timings}, indent=1) + "\n"
        )


def ensure_packages() -> None:
    if Path("/usr/sbin/sshd").exists() and shutil.which("rsync") and shutil.which("ssh"):
        return
    print("installing openssh-server and rsync (Debian) for Ray's local node provider", flush=True)
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", "openssh-server", "openssh-client", "rsync"]
    if subprocess.call(cmd) != 0:
        subprocess.check_call(["apt-get", "update"])
        subprocess.check_call(cmd)


def run(cmd: list[str] | str, env: dict, log: Log, out: Path, timeout_s: float, check: bool = True) -> int:
    """A command with its output in `out` (the tail goes to the log when it fails)."""
    with open(out, "ab") as f:
        rc = subprocess.call(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=REPO)
    if rc != 0:
        log(f"{cmd if isinstance(cmd, str) else ' '.join(cmd[:3])} exited {rc}; its output ends:")
        log(out.read_text(errors="replace")[-3000:])
        if check:
            raise RuntimeError(f"command failed ({rc}); see {out}")
    return rc


def prepare(token: str, services) -> dict[str, str]:
    """The run dir: ssh keys and sshd config, the sessions' HOME, the `ray` shim, cluster.env."""
    from deploy.nodes import FAST_FAILURE_DETECTION

    for d in ("ssh", "home", "bin", "nodes"):
        (RUN / d).mkdir(parents=True, exist_ok=True)
    ssh = RUN / "ssh"
    for name in ("host_ed25519", "id_ed25519"):
        subprocess.check_call(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh / name)])
    shutil.copy(ssh / "id_ed25519.pub", ssh / "authorized_keys")
    (ssh / "sshd_config").write_text(
        f"Port 22\nListenAddress 0.0.0.0\nHostKey {ssh / 'host_ed25519'}\nPidFile {ssh / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {ssh / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        f"SetEnv HOME={RUN / 'home'}\n"  # the sessions' HOME: nothing lands in the real one
    )
    path = f"{RUN / 'bin'}:{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    (RUN / "home" / ".bashrc").write_text(f"export PATH={path}\n")
    (RUN / "home" / ".profile").write_text(". ~/.bashrc\n")
    shim = RUN / "bin" / "ray"
    shim.write_text(
        "#!/bin/sh\n# `ray stop` (what `ray down` runs on the head) ends only this cluster's processes.\n"
        f'if [ "$1" = stop ]; then PYTHONPATH={REPO} exec {sys.executable} -m deploy.local_cluster '
        f'--marker {RUN / "nodes"}/ stop-marked; fi\nexec {VENV_BIN / "ray"} "$@"\n'
    )
    shim.chmod(0o755)
    # OpenSSH expands `~` in `-i ~/ray_bootstrap_key.pem` (the head's autoscaler reaching the workers) from the
    # passwd entry, not $HOME: this ssh on the sessions' PATH expands it from $HOME, the run dir's home.
    ssh_shim = RUN / "bin" / "ssh"
    ssh_shim.write_text(
        '#!/bin/bash\nargs=()\nfor a in "$@"; do case "$a" in "~/"*) args+=("$HOME/${a#\\~/}");; '
        '*) args+=("$a");; esac; done\nexec /usr/bin/ssh "${args[@]}"\n'
    )
    ssh_shim.chmod(0o755)
    env = {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        "RAY_USAGE_STATS_ENABLED": "0",
        "LORALAND_REDIS_URL": services.redis_url,
        "LORALAND_ADMIN_TOKEN": ADMIN,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(REPO),
        **FAST_FAILURE_DETECTION,
        **services.aws_env(),
    }
    (RUN / "cluster.env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    return env


def start_sshd(log: Log) -> subprocess.Popen:
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation dir
    proc = subprocess.Popen(
        ["/usr/sbin/sshd", "-D", "-e", "-f", str(RUN / "ssh" / "sshd_config")],
        stdout=open(RUN / "sshd.log", "ab"),  # noqa: SIM115 - the child holds it
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.2", 22), timeout=1).close()
            log(f"sshd (pid {proc.pid}) listening on :22 inside the namespace")
            return proc
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"sshd did not start; see {RUN / 'sshd.log'}")


def serve_config(model: Path) -> Path:
    """serve_config.yaml with what differs here: the tiny model, CPUs only, the local S3 and placement."""
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": 8000, "request_timeout_s": 300}
    app = config["applications"][0]
    app["args"].update(
        model=str(model),
        served_model_name="tiny-llama",
        replicas=2,
        replica_num_cpus=1,
        replica_num_gpus=0,
        adapter_store=f"s3://{BUCKET}",
        max_ongoing_requests=16,
        max_queued_requests=256,
        kernel={"max_adapters": 8, "max_batch_size": 16, "max_lora_rank": 16, "dtype": "float32"},
    )
    for d in app["deployments"]:
        if d["name"] == "LoraReplica":
            d.update(num_replicas=2, max_ongoing_requests=16)
            d["ray_actor_options"] = {"num_cpus": 1, "num_gpus": 0, "resources": {"loraland_replica": 1}}
        elif d["name"] == "Ingress":
            d["num_replicas"] = 1
            d["ray_actor_options"] = {"num_cpus": 0.25, "resources": {"loraland_ingress": 0.25}}
    out = RUN / "serve-local.yaml"
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out


def wait(predicate, timeout_s: float, what: str, every_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception:
            value = None
        if value:
            return value
        time.sleep(every_s)
    raise RuntimeError(f"timed out after {timeout_s}s waiting for {what}")


def inside() -> int:  # noqa: PLR0915 - one scripted story, step by step
    import openai

    from deploy.local_cluster import LocalCluster
    from deploy.processes import end_pids, pids_with_marker, refresh_ray_auth
    from tests.fixtures.cluster import Reference, push, tenant_key, tiny_adapters
    from tests.fixtures.models import build_tiny_model

    log = Log()
    left = pids_with_marker(f"{RUN}/nodes/")
    if left:  # a previous run that did not finish: its processes, found by this run dir's path
        log(f"ending {len(left)} processes left by a previous run")
        end_pids(left)
    shutil.rmtree(RUN, ignore_errors=True)
    RUN.mkdir(parents=True)
    services = LocalCluster(nodes=[], root=RUN / "services")
    sshd = ref = None
    token = secrets.token_hex(32)
    try:
        t = time.monotonic()
        services.start()
        env = prepare(token, services)
        sshd = start_sshd(log)
        model = build_tiny_model(RUN / "model")
        folders = tiny_adapters(RUN / "adapters", list(ADAPTERS))
        for name in ADAPTERS:
            push(services, model, name, folders[name], prefix=name)
        key = tenant_key(services, "alpha")
        ref = Reference(model, folders)
        log.step("prepared (Redis, S3, sshd, model, adapters, reference)", t)

        # RAY_UP_enable_autoscaler_v2=0: Ray 2.60's default autoscaler v2 counts the head toward the local
        # provider's one node type, so min_workers=2 started one worker; v1 starts both.
        client_env = {**os.environ, **env, "HOME": str(RUN / "home"), "RAY_UP_enable_autoscaler_v2": "0",
                      "PATH": f"{RUN / 'bin'}:{VENV_BIN}:" + os.environ.get("PATH", "")}  # fmt: skip
        t = time.monotonic()
        run([str(VENV_BIN / "ray"), "up", str(CONFIG), "--yes", "--no-config-cache"], client_env, log,
            RUN / "ray-up.out", 900)  # fmt: skip
        log.step("ray up returned", t)

        # A driver with the token: how many nodes registered (the autoscaler starts the workers after `up`).
        os.environ.update({k: v for k, v in env.items() if k.startswith("RAY_")})
        refresh_ray_auth()
        import ray
        from ray import serve

        ray.init(address="127.0.0.1:6379", log_to_driver=False)
        wait(lambda: sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]) == list(NODES), 600,
             "the head and both workers", every_s=2)  # fmt: skip
        log.step("ray up -> 3 nodes alive", t)
        no_token = {k: v for k, v in client_env.items() if k != "RAY_AUTH_TOKEN"}
        status = subprocess.run([str(VENV_BIN / "ray"), "status", "--address", "127.0.0.1:6379"],
                                env=no_token, capture_output=True, text=True, timeout=120)  # fmt: skip
        log(f"ray status without the token: exit {status.returncode} (refused, as it should be)")
        run([str(VENV_BIN / "ray"), "status", "--address", "127.0.0.1:6379"], client_env, log,
            RUN / "ray-status.out", 120)  # fmt: skip
        log("ray status with the token:\n" + (RUN / "ray-status.out").read_text()[-1500:])

        t = time.monotonic()
        cfg = serve_config(model)
        run([str(VENV_BIN / "serve"), "deploy", str(cfg), "--address", "http://127.0.0.1:8265"], client_env,
            log, RUN / "serve-deploy.out", 300)  # fmt: skip
        log.step("serve deploy accepted", t)

        def app_running():
            app = serve.status().applications.get("loraland")
            return app is not None and app.status == "RUNNING"

        wait(app_running, 600, "the Serve app to run", every_s=2)
        log.step("serve deploy -> application RUNNING", t)

        from app.catalog.store import Catalog

        with Catalog(services.redis_url) as catalog:
            replicas = wait(
                lambda: catalog.replicas() if len(catalog.replicas()) == 2 else None, 60, "heartbeats"
            )
            hosts = sorted(r.extra.get("node_ip") for r in replicas.values())
        log(f"replicas on {hosts} (the ingress and Serve's proxy on the head)")
        assert set(hosts) <= {"127.0.0.2", "127.0.0.3"}, hosts

        t = time.monotonic()
        client = openai.OpenAI(api_key=key, base_url="http://127.0.0.1:8000/v1", max_retries=0, timeout=300)
        prompt = "The quick brown fox"
        got = client.completions.create(model="ad0", prompt=prompt, max_tokens=8).choices[0].text
        assert got == ref.text(prompt, "ad0", 8), (got, ref.text(prompt, "ad0", 8))
        log.step("openai completions (adapter ad0), equal to the reference", t)
        log(f"  answer {got!r}")
        t = time.monotonic()
        chat = client.chat.completions.create(
            model="ad1", messages=[{"role": "user", "content": "hello"}], max_tokens=6
        )
        log.step("openai chat (adapter ad1)", t)
        log(f"  answer {chat.choices[0].message.content!r}")
        models = sorted(m.id for m in client.models.list().data)
        log(f"GET /v1/models: {models}")
        ray.shutdown()  # this driver leaves before the cluster goes

        t = time.monotonic()
        run([str(VENV_BIN / "ray"), "down", str(CONFIG), "--yes"], client_env, log, RUN / "ray-down.out", 300)
        gone = wait(lambda: not pids_with_marker(f"{RUN}/nodes/"), 60, "every node process to exit")
        log.step("ray down -> no process of the cluster left", t)
        assert gone
        log(f"total {time.monotonic() - log.t0:.1f}s")
        log("ray up output ends:\n" + (RUN / "ray-up.out").read_text(errors="replace")[-2500:])
        return 0
    except BaseException as e:
        log(f"FAILED: {type(e).__name__}: {e}")
        raise
    finally:
        if "ray" in sys.modules:
            sys.modules["ray"].shutdown()
        if ref is not None:
            ref.close()  # its step-loop thread would keep the process alive
        left = pids_with_marker(f"{RUN}/nodes/")
        if left:
            log(f"ending {len(left)} cluster processes still running")
            end_pids(left)
        if sshd is not None:
            sshd.terminate()
            sshd.wait(timeout=10)
        shutil.rmtree(RUN / "ssh", ignore_errors=True)  # the keys go with the sshd that trusted them
        services.stop()
        for f in ("cluster-loraland-local.lock", "cluster-loraland-local.state"):  # ray up's local state
            Path("/tmp/ray", f).unlink(missing_ok=True)
        log.save()


def main() -> int:
    if os.geteuid() != 0:
        print("ray_up_local: run as root (sshd, /run/sshd, a network namespace)", file=sys.stderr)
        return 2
    if "--inside" in sys.argv:
        return inside()
    ensure_packages()
    script = 'ip link set lo up && cd "$1" && exec "$2" -m load_tests.chaos.ray_up_local --inside'
    return subprocess.call(["unshare", "-n", "sh", "-c", script, "sh", str(REPO), sys.executable])


if __name__ == "__main__":
    sys.exit(main())
