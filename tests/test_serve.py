"""``atommem serve`` over real HTTP: a real server process (uvicorn) on a persistent Chroma folder, a real
client (httpx). Eight concurrent sessions batched through one policy with no cross-session read; bad
inputs each get one JSON 4xx line; a ``kill -9`` mid-load and a restart lose no acknowledged
observation; the memory page in headless Chromium. The sessions' policy is the heuristic baseline
(``--policy heuristic``: memories from every sentence, answers from the shown views), so that there are
atoms to isolate and to keep; one test serves the tiny checkpoint itself."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .conftest import REPO, free_port, require

NAMES = ["Ana", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from .conftest import tiny_agent_checkpoint

    return tiny_agent_checkpoint(tmp_path_factory.mktemp("serve"))


class Server:
    """``atommem serve`` as a child process; ``kill9`` ends it the hard way."""

    def __init__(self, checkpoint, store, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "atommem_rl.cli", "serve", str(checkpoint), "--store", str(store),
                     "--port", str(self.port), *extra]
        self.proc = None

    def start(self, timeout: float = 180) -> "Server":
        self.proc = subprocess.Popen(self.argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}: {self.proc.stderr.read()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError("server did not come up")

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill9()


@pytest.fixture
def server(checkpoint, tmp_path):
    s = Server(checkpoint, tmp_path / "store", "--policy", "heuristic", "--max-body", "4096").start()
    yield s
    s.stop()


def fact(name: str, n: int) -> str:
    return f"{name} keeps the item number {n} inside box {name}{n}."


@pytest.mark.slow
def test_eight_concurrent_sessions_are_isolated_and_batched(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for name in NAMES:
            assert c.post("/sessions", json={"session": name.lower()}).status_code == 201

        def work(name: str) -> tuple[dict, dict]:
            with httpx.Client(base_url=server.url, timeout=120) as cc:
                for n in range(2):
                    r = cc.post(f"/sessions/{name.lower()}/observe", json={"text": fact(name, n)})
                    assert r.status_code == 200, r.text
                r = cc.post(f"/sessions/{name.lower()}/ask", json={"question": f"Which box holds {name}'s item?"})
                assert r.status_code == 200, r.text
                return r.json(), cc.get(f"/sessions/{name.lower()}/memories").json()

        with ThreadPoolExecutor(len(NAMES)) as pool:
            results = dict(zip(NAMES, pool.map(work, NAMES)))
        cross = 0
        for name, (reply, mem) in results.items():
            texts = [m["text"] for m in mem["memories"]] + [v["text"] for v in reply["read"]]
            assert any(name in t for t in texts)
            cross += sum(other in t for t in texts for other in NAMES if other != name)
            assert reply["answer"] is not None
        assert cross == 0
        health = c.get("/health").json()
        # concurrent sessions shared policy calls: more sessions stepped than rounds run
        assert health["batched_sessions"] > health["policy_rounds"] >= 1, health
        spec = c.get("/openapi.json").json()
        assert {"/sessions", "/sessions/{sid}/observe", "/sessions/{sid}/ask"} <= set(spec["paths"])


def test_bad_inputs_each_get_one_json_4xx_line(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.post("/sessions", json={"session": "alice"}).status_code == 201
        cases = {
            "oversized body": (413, dict(json={"text": "x" * 5000})),
            "malformed JSON": (400, dict(content=b'{"text": ', headers={"content-type": "application/json"})),
            "wrong type": (422, dict(json={"text": 5})),
            "unknown field": (422, dict(json={"text": "hi there you", "txt": 1})),
            "two kinds": (422, dict(json={"text": "a b c d", "messages": [{"role": "user", "content": "x"}]})),
            "empty turns": (422, dict(json={"messages": []})),
        }
        for what, (status, kw) in cases.items():
            r = c.post("/sessions/alice/observe", **kw)
            assert r.status_code == status, (what, r.status_code, r.text)
            assert r.text.count("\n") == 0 and list(r.json()) == ["error"] and "Traceback" not in r.text, what
        for method, path, body, status in [("post", "/sessions/nobody/observe", {"text": "a b c d"}, 404),
                                           ("post", "/sessions/nobody/ask", {"question": "q?"}, 404),
                                           ("get", "/sessions/nobody/memories", None, 404),
                                           ("delete", "/sessions/nobody", None, 404),
                                           ("post", "/sessions", {"session": "alice"}, 409),
                                           ("post", "/sessions", {"session": "../etc"}, 400),
                                           ("post", "/sessions/alice/ask", {"question": ""}, 422),
                                           ("post", "/sessions/alice/ask", {"question": ["q"]}, 422)]:
            r = c.request(method.upper(), path, json=body)
            assert r.status_code == status and list(r.json()) == ["error"], (path, r.status_code, r.text)
        assert c.get("/sessions/alice/memories").json()["memories"] == []  # nothing bad was stored
        assert c.delete("/sessions/alice").json() == {"session": "alice", "deleted": True}
        assert c.get("/sessions/alice/memories").status_code == 404


@pytest.mark.slow
def test_kill9_mid_load_loses_no_acknowledged_observation(checkpoint, tmp_path):
    store = tmp_path / "store"
    server = Server(checkpoint, store, "--policy", "heuristic").start()
    sessions = [n.lower() for n in NAMES[:4]]
    acked: dict[str, list[str]] = {s: [] for s in sessions}
    stop = threading.Event()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for s in sessions:
                assert c.post("/sessions", json={"session": s}).status_code == 201

        def load(s: str) -> None:
            with httpx.Client(base_url=server.url, timeout=30) as cc:
                n = 0
                while not stop.is_set():
                    text = fact(s.capitalize(), n)
                    try:
                        r = cc.post(f"/sessions/{s}/observe", json={"text": text})
                    except httpx.HTTPError:
                        return  # the server is gone: this one was never acknowledged
                    if r.status_code == 200:
                        acked[s].append(text)
                    n += 1

        threads = [threading.Thread(target=load, args=(s,)) for s in sessions]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        while sum(map(len, acked.values())) < 12 and time.monotonic() - t0 < 300:
            time.sleep(0.05)
        server.kill9()  # mid-load: requests are in flight
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert sum(map(len, acked.values())) >= 12
        server = Server(checkpoint, store, "--policy", "heuristic").start()
        with httpx.Client(base_url=server.url, timeout=60) as c:
            assert set(c.get("/sessions").json()["sessions"]) == set(sessions)
            for s in sessions:
                stored = " ".join(m["text"] for m in c.get(f"/sessions/{s}/memories").json()["memories"])
                lost = [t for t in acked[s] if t.rstrip(".") not in stored]
                assert not lost, (s, lost)
            # and the sessions go on
            assert c.post(f"/sessions/{sessions[0]}/observe", json={"text": fact("Zed", 1)}).status_code == 200
    finally:
        stop.set()
        server.stop()


@pytest.mark.slow
def test_memory_page_in_headless_chromium(server, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    require(chromium is not None, "needs Debian's chromium (apt-get install -y chromium)")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        c.post("/sessions", json={"session": "page"})
        c.post("/sessions/page/observe", json={"documents": [{"title": "Lab", "text": "The centrifuge stands in "
                                                              "room 120 of the east wing."},
                                                             "A note says <script>alert(1)</script> is not code here."]})
    url = server.url + "/sessions/page/page?q=centrifuge%20room"
    base = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000"]
    shot = tmp_path / "memory_page.png"
    out = subprocess.run(base + ["--window-size=1200,900", f"--screenshot={shot}", url], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and shot.stat().st_size > 5000, out.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dom = subprocess.run(base + ["--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    assert "room 120 of the east wing" in dom and "Retrieved for" in dom
    assert "<script" not in dom and "&lt;script" in dom  # stored text is escaped (and defanged by the env)
    if os.environ.get("ATOMMEM_ARTIFACTS"):  # CI keeps the screenshot
        shutil.copy(shot, os.environ["ATOMMEM_ARTIFACTS"])


@pytest.mark.slow
def test_serving_the_tiny_checkpoint_itself(checkpoint, tmp_path):
    server = Server(checkpoint, tmp_path / "store", "--max-new-tokens", "16").start()
    try:
        with httpx.Client(base_url=server.url, timeout=300) as c:
            assert c.post("/sessions", json={"session": "m"}).status_code == 201
            r = c.post("/sessions/m/observe", json={"messages": [{"role": "user", "content": "My cat is Miso."}]})
            assert r.status_code == 200 and r.json()["blocks"] == 1 and r.json()["steps"] == 1
            r = c.post("/sessions/m/ask", json={"question": "What is the cat called?"})
            assert r.status_code == 200 and set(r.json()) == {"answer", "read", "steps"}
    finally:
        server.stop()


@pytest.mark.slow
def test_bench_serve_reports_both_modes_side_by_side(checkpoint):
    """``atommem bench serve --json`` on the tiny checkpoint: both modes measured, their ratio reported
    (the 135M figure is in docs/BENCHMARKS.md; here only that the benchmark runs and adds up)."""
    from .cli_helpers import run_cli

    res = run_cli(["bench", "serve", "--model", str(checkpoint), "--sessions", "3", "--repeats", "1",
                   "--max-new-tokens", "4", "--json"], timeout=600)
    assert res.rc == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["sessions"] == 3 and len(out["runs"]["batched"]) == len(out["runs"]["one_at_a_time"]) == 1
    assert out["ratio"] == pytest.approx(out["batched_obs_per_s"] / out["one_at_a_time_obs_per_s"], rel=1e-2)
