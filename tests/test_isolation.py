"""Eight rollout worker processes against one ``chroma run`` server: no errors, no leaks.

Each worker process runs batches of heuristic-policy episodes (``run_rollouts``, batch 4) on the
shared server until its time is up. A wrapper policy gives every episode a unique marker
(``ISO`` + 12 hex digits), adds one ``create_memory`` holding the marker to each chunk step and one
``read_memory`` for marker text to every step, so retrieval is asked each step for exactly the kind
of atom other episodes hold. Checked in the worker:

* every observation (every message of every prompt) contains no marker but the episode's own;
* after the episode, its namespace read straight from Chroma (``collection.get`` and a
  ``collection.query`` for marker text, no mirror in between) holds only its own marker, and the
  store reopened from Chroma equals the memory the episode recorded;
* no crash, no store failure, no skipped episode.

Duration per worker: ``ATOMMEM_SOAK_SECONDS`` of rollouts (default 100, about 3 minutes in all with
the workers' start-up on 2 cores; raise it for soak runs), then the batch in flight finishes:

    ATOMMEM_SOAK_SECONDS=1800 .venv/bin/python -m pytest tests/test_isolation.py -s
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from .conftest import REPO, ChromaServer

WORKERS = 8
MARKER = re.compile(r"ISO[0-9a-f]{12}")
ENV = dict(tokenizer="words", chunk_tokens=96, max_prompt_tokens=2400, embedder="hashing:64",
           max_answer_steps=3, read_budget=4, answer_read_budget=4)


class MarkerPolicy:
    """Heuristic actions plus one marker atom per chunk step and one marker read per step; checks
    every observation for foreign markers (a decorator around a real policy, not a script)."""

    def __init__(self, inner):
        self.inner, self.name = inner, "heuristic+marker"
        self.markers: dict = {}
        self.by_task: dict[str, str] = {}
        self.steps: dict = {}
        self.violations: list[dict] = []
        self.observations = 0
        self.own_seen = 0  # observations showing the episode's own marker: retrieval does surface markers

    def start(self, key, task):
        self.markers[key] = self.by_task[task.id] = "ISO" + uuid.uuid4().hex[:12]
        self.steps[key] = 0
        self.inner.start(key, task)

    def end(self, key):
        self.inner.end(key)

    def act(self, batch):
        from envs.parser import format_tool_call as tc

        actions = self.inner.act(batch)
        out = []
        for (key, obs, info), action in zip(batch, actions):
            own = self.markers[key]
            self.observations += 1
            seen = {m for msg in obs for m in MARKER.findall(msg["content"])}
            self.own_seen += own in seen
            foreign = seen - {own}
            if foreign:
                self.violations.append({"own": own, "foreign": sorted(foreign), "step": self.steps[key]})
            extra = tc("read_memory", {"query": "Marker ISO ledger code"})
            if info.get("phase") == "chunks":
                extra = tc("create_memory", {"content": f"Marker {own} step {self.steps[key]}: ledger code {own}."}) + extra
            self.steps[key] += 1
            out.append(extra + "\n" + action)
        return out


def worker(port: int, seconds: float, wid: int, sync_dir: str) -> dict:
    """One rollout worker process: episodes until ``seconds`` pass; returns its counts and findings.
    Workers start together (a barrier of files in ``sync_dir``), so all eight load the server at once."""
    from atommem_rl.memory.chroma_clients import make_client
    from atommem_rl.memory.store import COLLECTION_PREFIX, AtomStore
    from atommem_rl.rollout import make_policy, run_rollouts, summarize
    from atommem_rl.tasks.synth import generate_task

    client = make_client("http", port=port)
    policy = MarkerPolicy(make_policy("heuristic"))
    stats = {"worker": wid, "episodes": 0, "steps": 0, "atoms_checked": 0, "errors": [], "violations": []}

    def check(rec):  # straight from Chroma: the namespace holds this episode's marker only
        ns = rec["namespace"]
        col = client.get_collection(COLLECTION_PREFIX + ns)
        docs = col.get(include=["documents"])["documents"]
        hits = col.query(query_texts=["Marker ISO ledger code"], n_results=min(10, max(1, len(docs))),
                         include=["documents"])["documents"][0]
        found = {m for d in docs + hits for m in MARKER.findall(d)}
        own = policy.by_task[rec["task_id"]]
        if found != {own}:
            stats["violations"].append({"namespace": ns, "own": own, "found": sorted(found)})
        if AtomStore.open(ns, client=client).snapshot() != rec["memory"]:
            stats["errors"].append(f"{ns}: Chroma differs from the episode's acknowledged memory")
        stats["atoms_checked"] += len(docs)
        client.delete_collection(COLLECTION_PREFIX + ns)

    (Path(sync_dir) / f"ready-{wid}").touch()
    wait = time.monotonic() + 600
    while len(list(Path(sync_dir).glob("ready-*"))) < WORKERS and time.monotonic() < wait:
        time.sleep(0.2)
    deadline = time.monotonic() + seconds
    batch = 0
    while time.monotonic() < deadline:
        tasks = [generate_task(batch * 4 + i, 1000 + wid, docs=4, questions=2, confounders=1) for i in range(4)]
        batch += 1
        for i, t in enumerate(tasks):
            t.id = f"w{wid}-b{batch}-{i}"
        trajs = run_rollouts(tasks, policy, dict(ENV, client=client), batch_size=4, seed=batch,
                             keep_memory=True, retries=0, on_episode=check)
        s = summarize(trajs, "heuristic")
        if s["crashes"] or s["store_failures"] or s["skipped"]:
            stats["errors"].append({k: s[k] for k in ("crashes", "store_failures", "skipped")})
            stats["errors"] += [t.get("traceback") or t.get("failures") for t in trajs
                                if t.get("crashed") or t.get("failures")]
        stats["episodes"] += len(trajs)
        stats["steps"] += sum(len(t["steps"]) for t in trajs)
    stats["observations"] = policy.observations
    stats["own_marker_seen"] = policy.own_seen
    stats["violations"] += policy.violations
    return stats


@pytest.mark.slow
def test_eight_workers_one_server_isolated(tmp_path):
    seconds = float(os.environ.get("ATOMMEM_SOAK_SECONDS", "100"))
    server = ChromaServer(tmp_path / "db").start()
    procs = []
    try:
        code = ("import json, sys; from tests.test_isolation import worker; "
                "print(json.dumps(worker(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4])))")
        sync = tmp_path / "sync"
        sync.mkdir()
        t0 = time.monotonic()
        for wid in range(WORKERS):
            procs.append(subprocess.Popen([sys.executable, "-c", code, str(server.port), str(seconds), str(wid), str(sync)],
                                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        results = []
        for p in procs:
            out, err = p.communicate(timeout=seconds + 600)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
        wall = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.stop()
    episodes = sum(r["episodes"] for r in results)
    print(json.dumps({"workers": WORKERS, "seconds": seconds, "wall_s": round(wall, 1), "episodes": episodes,
                      "steps": sum(r["steps"] for r in results), "observations": sum(r["observations"] for r in results),
                      "atoms_checked": sum(r["atoms_checked"] for r in results),
                      "own_marker_seen": sum(r["own_marker_seen"] for r in results)}))
    for r in results:
        assert r["episodes"] >= 4, r  # every worker ran at least one batch to the end
        assert r["errors"] == [], r["errors"][:3]
        assert r["violations"] == [], r["violations"][:3]
        assert r["observations"] >= r["steps"] > 0 and r["atoms_checked"] > 0
        assert r["own_marker_seen"] > 0  # the check is live: marker atoms do reach the prompts
