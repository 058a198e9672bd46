"""``atommem bench serve``: observe throughput of ``atommem serve``'s batching, N sessions stepped
together through one policy call per round against the same sessions served one at a time.

Method. One policy (``--model``, default SmolLM2-135M-Instruct, HF generate on this machine's CPU,
greedy, at most ``--max-new-tokens`` per action) and ``--sessions`` MemoryAgents on fresh in-memory
namespaces of one Chroma client, in the environment the model folder records (a question-hidden
reading prompt by default). Each session observes its own document of ``--sentences`` sentences
(one chunk). A run is one observation per session: *batched* = ``observe_many`` over all sessions
(what the server's worker calls; every round is one generate call for all of them), *one at a time*
= ``observe`` per session in turn. Runs alternate, batched then one-at-a-time, ``--repeats`` times
after one unmeasured warm-up observation, so both see the same machine load; every run uses new
namespaces. Reported: the median observations per second of each mode (and every run's), and
``ratio`` = batched / one-at-a-time of the medians.

    atommem bench serve --json
    atommem bench serve --sessions 8 --repeats 3 --max-new-tokens 64 --json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
import uuid

from ..commands import at_most


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct base)")
    parser.add_argument("--sessions", type=at_most(256), default=8, help="concurrent sessions (default 8)")
    parser.add_argument("--repeats", type=at_most(50), default=3, help="measured runs per mode (default 3)")
    parser.add_argument("--sentences", type=at_most(50), default=3, help="sentences per observed document (default 3)")
    parser.add_argument("--max-new-tokens", type=at_most(4096), default=64, help="per action (default 64)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001 - a missing lscpu must not lose the measurement
        return platform.processor() or "unknown"


def document(i: int, n: int, run: str) -> str:
    return " ".join(f"Person {i} of run {run} keeps item {k} in the box labelled {i}-{k}." for k in range(n))


def main(args) -> int:
    from atommem_rl.agent import MemoryAgent, observe_many
    from atommem_rl.policies.model_policy import default_model_path

    model = args.model or default_model_path()
    t0 = time.perf_counter()
    first = MemoryAgent.from_pretrained(model, namespace=f"bench-{uuid.uuid4().hex[:8]}",
                                        env={"questions": "hidden"}, max_new_tokens=args.max_new_tokens)
    load_s = time.perf_counter() - t0

    def run(batched: bool) -> float:
        tag = uuid.uuid4().hex[:8]
        agents = [first.open(f"bench-{tag}-{i}") for i in range(args.sessions)]
        docs = [document(i, args.sentences, tag) for i in range(args.sessions)]
        t = time.perf_counter()
        if batched:
            observe_many(list(zip(agents, docs)))
        else:
            for a, d in zip(agents, docs):
                a.observe(d)
        seconds = time.perf_counter() - t
        for a in agents:
            a.delete()
        return args.sessions / seconds

    warm = first.open(f"bench-warm-{uuid.uuid4().hex[:8]}")
    warm.observe(document(0, args.sentences, "warm-up"))  # allocator and kernels warm, not measured
    warm.delete()
    batched, single = [], []
    for r in range(args.repeats):
        batched.append(run(True))
        single.append(run(False))
        print(f"run {r + 1}/{args.repeats}: batched {batched[-1]:.4f} obs/s, one at a time {single[-1]:.4f} obs/s",
              file=sys.stderr, flush=True)  # a long benchmark shows its progress
    first.delete()
    mb, ms = statistics.median(batched), statistics.median(single)
    out = {"benchmark": "serve", "machine": cpu_name(), "model": model, "backend": "hf",
           "sessions": args.sessions, "repeats": args.repeats, "sentences": args.sentences,
           "max_new_tokens": args.max_new_tokens, "model_load_s": round(load_s, 2),
           "batched_obs_per_s": round(mb, 4), "one_at_a_time_obs_per_s": round(ms, 4),
           "ratio": round(mb / ms, 3), "runs": {"batched": [round(x, 4) for x in batched],
                                               "one_at_a_time": [round(x, 4) for x in single]}}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{args.sessions} sessions: batched {mb:.3f} obs/s, one at a time {ms:.3f} obs/s, ratio {mb / ms:.2f}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    main(argparse.ArgumentParser().parse_args())
