"""GET /status in a real browser: headless Chromium (Debian's `chromium`) driven over the DevTools protocol (a
websocket; no Selenium, no Node). The page asks for the admin token (auth is on), lists the adapters and the
replica, and its numbers follow new requests by refreshing itself; a screenshot lands in load_tests/results/."""

from __future__ import annotations

import base64
import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from app.catalog.redis_server import free_port
from tests.fixtures.served_stack import ADMIN, REPLICA, ServedStack
from tests.fixtures.services import redis_server  # noqa: F401
from tests.fixtures.system_tools import ensure_tool

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "load_tests" / "results" / "status_page.png"
pytestmark = pytest.mark.timeout(300)


class Browser:
    """One headless Chromium with one page, and a minimal DevTools client for it."""

    def __init__(self, binary: str, url: str, profile: Path):
        from websockets.sync.client import connect

        port = free_port()
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             f"--remote-debugging-port={port}", "--remote-debugging-address=127.0.0.1", f"--user-data-dir={profile}",
             "--no-first-run", "--no-default-browser-check", "--disable-background-networking", "--disable-sync",
             "--disable-component-update", "--disable-default-apps", "--window-size=1400,1000", url],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        target = None
        while target is None:
            try:
                pages = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=2, trust_env=False).json()
                target = next((p for p in pages if p.get("type") == "page"), None)
            except (httpx.HTTPError, ValueError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("chromium did not open its DevTools endpoint")
            time.sleep(0.2)
        self.ws = connect(target["webSocketDebuggerUrl"], max_size=64 << 20, open_timeout=30)
        self._id = 0

    def call(self, method: str, **params) -> dict:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def js(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait(self, expression: str, timeout_s: float = 60):
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            try:
                value = self.js(expression)
            except RuntimeError as e:  # the page is still loading: its elements are not there yet
                value, last = None, e
            if value:
                return value
            time.sleep(0.25)
        raise AssertionError(f"still false after {timeout_s}s: {expression} ({last})")

    def screenshot(self, path: Path) -> None:
        png = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(png))

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def stack(redis_server, llama_dir, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("status-adapters")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LORALAND_CACHE_DIR", str(tmp_path_factory.mktemp("status-cache")))
        s = ServedStack(redis_server, llama_dir, root)
    yield s
    s.close()


def _requests_cell(adapter: str) -> str:
    """JS: the requests column of `adapter`'s row in the adapters table, as a number (null while absent)."""
    return (
        "(() => { for (const tr of document.querySelectorAll('#adapters tbody tr')) {"
        f" if (tr.cells[0].textContent.trim() === {json.dumps(adapter)})"
        " return Number(tr.cells[5].textContent.replace(/,/g, '')); } return null; })()"
    )


def test_status_page_in_headless_chromium(stack, tmp_path):
    chromium = ensure_tool("chromium", "chromium")
    a, b = stack.adapters["a"], stack.adapters["b"]
    for tenant, adapter in (("alpha", "a"), ("alpha", "a"), ("beta", "b")):
        stack.complete(tenant, adapter, "status page traffic")
    browser = Browser(chromium, f"{stack.base}/status", tmp_path / "profile")
    try:
        # Auth is on: the page asks for the admin token, as it would ask a person.
        browser.wait("getComputedStyle(document.getElementById('login')).display !== 'none'")
        browser.js(
            f"document.getElementById('token').value = {json.dumps(ADMIN)};"
            "document.getElementById('login').requestSubmit(); true"
        )
        browser.wait(f"{_requests_cell(a)} === 2 && {_requests_cell(b)} === 1")
        replicas = browser.js(
            "[...document.querySelectorAll('#replicas tbody tr')].map(r => r.cells[0].textContent)"
        )
        assert replicas == [REPLICA]
        tenants = browser.js(
            "[...document.querySelectorAll('#tenants tbody tr')].map(r => r.cells[0].textContent)"
        )
        assert set(stack.tenants.values()) <= set(tenants)
        assert (
            browser.js("document.querySelectorAll('#loads tbody tr').length") >= 2
        )  # a's and b's first loads
        updates = int(browser.js("document.body.dataset.updates"))

        for _ in range(3):  # more traffic: the open page shows it without a reload
            stack.complete("beta", "a", "more traffic")
        browser.wait(f"{_requests_cell(a)} === 5", timeout_s=30)
        assert int(browser.js("document.body.dataset.updates")) > updates
        tier = browser.js(
            "[...document.querySelectorAll('#adapters tbody tr')]"
            f".find(tr => tr.cells[0].textContent.trim() === {json.dumps(a)}).cells[3].textContent"
        )
        assert tier in ("device", "host")  # a replica holds it (the heartbeat may lag the device slot)
        browser.screenshot(SCREENSHOT)
    finally:
        browser.close()
    assert SCREENSHOT.stat().st_size > 10_000


def test_status_data_needs_the_admin_token(stack):
    assert httpx.get(f"{stack.base}/status", timeout=10).status_code == 200  # the page holds no data
    assert httpx.get(f"{stack.base}/status/data", timeout=10).status_code == 401
    tenant = {"Authorization": f"Bearer {stack.keys['alpha']}"}
    assert httpx.get(f"{stack.base}/status/data", headers=tenant, timeout=10).status_code == 403
    data = httpx.get(
        f"{stack.base}/status/data", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10
    ).json()
    assert {"adapters", "replicas", "tenants", "errors", "loads", "outcomes"} <= set(data)
