"""The Chroma server killed under the store and under rollouts (issue 6, fault tolerance).

A real ``chroma run`` on 127.0.0.1 with a persistent path (tests/conftest.py ChromaServer) is
SIGKILLed while episodes are running and restarted on the same path and port. Checked:

* a write that hits the dead server raises StoreUnavailableError naming the URL and the operation,
  leaves the store's mirror as it was, and the mirror equals Chroma again after the restart;
* the rollout engine fails the affected attempts with that error, retries them after the server is
  back (or skips them when it never comes back), counts both, and the run completes;
* every write the store acknowledged (in finished episodes and in failed attempts) is in Chroma
  after the restart.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from atommem_rl.memory.chroma_clients import make_client
from atommem_rl.memory.embeddings import HashingEmbedder
from atommem_rl.memory.errors import StoreUnavailableError
from atommem_rl.memory.store import AtomStore
from atommem_rl.policies.heuristic import HeuristicPolicy
from atommem_rl.rollout import make_policy, run_rollouts, summarize
from atommem_rl.tasks.schema import save_tasks
from atommem_rl.tasks.synth import generate_task

from .conftest import REPO, ChromaServer, free_port

ENV = dict(tokenizer="words", chunk_tokens=96, max_prompt_tokens=2400, embedder="hashing:64", max_answer_steps=3)


def tasks(n: int, seed: int = 5):
    return [generate_task(i, seed, docs=4, questions=2, confounders=1) for i in range(n)]


def assert_acknowledged(client, namespace: str, acked: list[dict]) -> int:
    """Every atom the store acknowledged is in Chroma with its acknowledged text (or, when a later
    write whose outcome was unknown did land, with that text kept in the atom's history)."""
    stored = {a["id"]: a for a in AtomStore.open(namespace, client=client).snapshot()}
    for atom in acked:
        got = stored.get(atom["id"])
        assert got is not None, f"acknowledged atom {atom['id']} of {namespace} is missing"
        assert got["text"] == atom["text"] or atom["text"] in [h["text"] for h in got["history"]], (atom, got)
    return len(acked)


class KillingPolicy(HeuristicPolicy):
    """The heuristic policy; right before its ``kill_at_call``-th batch of actions is stepped, the
    server is SIGKILLed (episodes are open and hold acknowledged atoms) and a thread restarts it on
    the same path and port ``down_seconds`` later."""

    def __init__(self, server: ChromaServer, kill_at_call: int, down_seconds: float | None):
        super().__init__()
        self.server, self.kill_at_call, self.down_seconds = server, kill_at_call, down_seconds
        self.calls = 0
        self.restarter = threading.Thread(target=lambda: (time.sleep(self.down_seconds), self.server.start()))

    def act(self, batch):
        self.calls += 1
        if self.calls == self.kill_at_call:
            self.server.kill()
            if self.down_seconds is not None:  # None: it never comes back
                self.restarter.start()
        return super().act(batch)


def test_store_outage_leaves_mirror_in_sync(tmp_path, namespace):
    server = ChromaServer(tmp_path / "db").start()
    url = f"http://127.0.0.1:{server.port}"
    try:
        store = AtomStore(namespace, client=make_client("http", port=server.port), embedder=HashingEmbedder(64))
        a = store.create("Ann lives in Oslo", participants=["Ann"])
        b = store.create("Ann lives in Bergen", participants=["Ann"])
        store.update(b.id, "Ann lives in Bergen since 2023")
        before = store.snapshot()
        server.kill()
        writes = [
            # create asks Chroma which of its new ids are taken before it adds (writer-scoped ids)
            ("checking new ids", lambda: store.create("written while the server is down")),
            ("updating an atom", lambda: store.update(a.id, "Ann lived in Oslo")),
            ("deleting an atom", lambda: store.delete(a.id)),
            ("relating atoms", lambda: store.relate(b.id, a.id, "conflict")),
            ("querying atoms", lambda: store.read("Where does Ann live?")),
        ]
        for operation, write in writes:
            with pytest.raises(StoreUnavailableError) as info:
                write()
            err = info.value
            assert err.url == url and url in str(err)  # ours, naming the server ...
            # ... and the operation (the first call may be the resync the earlier failure asked for)
            assert err.operation in (operation, "loading atoms") and err.operation in str(err)
            assert store.snapshot() == before  # the mirror is untouched by a failed write
        server.start()
        store.update(a.id, "Ann lived in Oslo until 2023")  # resyncs from Chroma first, then writes
        store.relate(b.id, a.id, "conflict")
        reopened = AtomStore.open(namespace, client=make_client("http", port=server.port))
        assert reopened.snapshot() == store.snapshot()  # mirror == Chroma
        texts = {x["id"]: x["text"] for x in reopened.snapshot()}
        assert texts[b.id] == "Ann lives in Bergen since 2023" and texts[a.id] == "Ann lived in Oslo until 2023"
        assert "written while the server is down" not in texts.values()
    finally:
        server.stop()


@pytest.mark.slow
def test_server_killed_mid_rollouts_retried_and_acknowledged_writes_kept(tmp_path):
    server = ChromaServer(tmp_path / "db").start()
    try:
        client = make_client("http", port=server.port)
        cfg = dict(ENV, client=client)

        policy = KillingPolicy(server, kill_at_call=3, down_seconds=3.0)
        n = 8
        # retries cover about a minute of outage: a loaded machine can take that long to restart the server
        trajs = run_rollouts(tasks(n), policy, cfg, batch_size=4, retries=8, retry_backoff=1.0, max_backoff=10.0,
                             keep_memory=True)
        policy.restarter.join(60)
        summary = summarize(trajs, "heuristic")
        assert summary["crashes"] == 0 and summary["skipped"] == 0, (
            summary, [t.get("traceback") or t["failures"][-1:] for t in trajs if t["crashed"] or t["skipped"]])
        assert summary["episodes"] == n and sorted(t["task_id"] for t in trajs) == sorted(t.id for t in tasks(n))
        assert summary["store_failures"] >= 1 and summary["retried"] >= 1, summary
        failed = [f for t in trajs for f in t["failures"]]
        for f in failed:
            assert f["url"] == f"http://127.0.0.1:{server.port}" and f["url"] in f["error"]
            assert f["operation"] and "Traceback" not in f["error"]
        retried = [t for t in trajs if t["failures"]]
        for t in retried:
            assert t["attempts"] == len(t["failures"]) + 1 and t["steps"] and t["terminated"] is not None
        # every acknowledged write is in Chroma after the restart: finished episodes' whole memory,
        # and the memory each failed attempt had been acknowledged before the server died
        fresh = make_client("http", port=server.port)
        checked = 0
        for t in trajs:
            checked += assert_acknowledged(fresh, t["namespace"], t["memory"])
            assert AtomStore.open(t["namespace"], client=fresh).snapshot() == t["memory"]  # finished: exact
        for f in failed:
            if f["namespace"] is not None:
                checked += assert_acknowledged(fresh, f["namespace"], f["memory"])
        assert checked > 20
        assert any(f["memory"] for f in failed), "the kill should have hit episodes holding acknowledged atoms"
    finally:
        server.stop()


def test_server_that_never_returns_skips_and_ends_the_run(tmp_path):
    server = ChromaServer(tmp_path / "db").start()
    try:
        client = make_client("http", port=server.port)
        t0 = time.monotonic()
        # the server dies before the second step of the first two episodes and never comes back
        policy = KillingPolicy(server, kill_at_call=2, down_seconds=None)
        trajs = run_rollouts(tasks(5), policy, dict(ENV, client=client), batch_size=2, retries=2, retry_backoff=0.1)
        summary = summarize(trajs, "heuristic")
        assert len(trajs) == 5 and summary["episodes"] == 0 and summary["skipped"] == 5
        assert summary["crashes"] == 0 and summary["store_failures"] == 5 * 3  # 1 attempt + 2 retries each
        first = [t["failures"][0] for t in trajs]
        assert sum(1 for f in first if f["step"] == 1 and f["memory"]) == 2  # the two hit mid-episode
        assert sum(1 for f in first if f["step"] == 0) == 3  # the others could not even open
        for t in trajs:
            assert t["skipped"] and t["attempts"] == 3 and t["score"] is None
            assert all(f"127.0.0.1:{server.port}" in f["error"] for f in t["failures"])
        assert time.monotonic() - t0 < 120  # bounded: no waiting forever on a dead server
    finally:
        server.stop()


@pytest.mark.slow
def test_cli_rollout_on_a_server(tmp_path):
    path = tmp_path / "tasks.jsonl"
    save_tasks(tasks(2), path)
    cli = [sys.executable, "-m", "atommem_rl.cli", "rollout", "--tasks", str(path), "--policy", "oracle",
           "--tokenizer", "words", "--chunk-tokens", "96", "--max-prompt-tokens", "2400"]
    # unreachable server: a clear error before any work, nothing written
    port = free_port()
    out = subprocess.run(cli + ["--out", str(tmp_path / "x.jsonl"), "--chroma", f"http://127.0.0.1:{port}"],
                         cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode != 0 and f"127.0.0.1:{port}" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "x.jsonl").exists()
    server = ChromaServer(tmp_path / "db").start()
    try:
        out = subprocess.run(cli + ["--out", str(tmp_path / "o.jsonl"), "--chroma", f"http://127.0.0.1:{server.port}",
                                    "--keep-memory", "--retries", "1"],
                             cwd=REPO, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr
        summary = json.loads(out.stdout.strip().splitlines()[-1])
        assert summary["episodes"] == 2 and summary["skipped"] == 0 and summary["store_failures"] == 0
        recs = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
        client = make_client("http", port=server.port)
        for r in recs:  # --keep-memory: the namespace outlives the run, equal to the recorded memory
            assert AtomStore.open(r["namespace"], client=client).snapshot() == r["memory"]
    finally:
        server.stop()
