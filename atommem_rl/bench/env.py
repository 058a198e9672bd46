"""``atommem bench env``: environment overhead per step (parsing, memory operations, prompt assembly).

Method. One synthetic document task is opened in ``DocumentEnv`` with the hashing embedder (so model
inference is out of the figure), the policy's real tokenizer (SmolLM2 by default) and in-memory
Chroma; ``--atoms`` atoms are preloaded into its store. Each measured step is a typical action: one
``create_memory`` with a fact of the current chunk, one ``read_memory``, one ``label_relation``
between two existing atoms, and a scratchpad rewrite. The time of ``env.step`` is measured with
``perf_counter`` after ``--warmup`` unmeasured steps; a new episode (with the same preload) starts
when one ends. Reported: median and p95 milliseconds, and the split of a step into its parts
(``parse_ms``, ``tools_ms``, ``prompt_ms``; medians).

    atommem bench env --atoms 1000 --steps 200 --json
"""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--atoms", type=int, default=1000, help="atoms preloaded into memory (default 1000)")
    parser.add_argument("--steps", type=int, default=200, help="measured steps (default 200)")
    parser.add_argument("--warmup", type=int, default=10, help="unmeasured steps first (default 10)")
    parser.add_argument("--tokenizer", default=None, help="policy tokenizer (default SmolLM2)")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--max-prompt-tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def main(args) -> int:
    import random
    import time

    from atommem_rl.tasks.synth import generate_task
    from envs.documents import DocumentEnv
    from envs.parser import format_tool_call as tc

    rng = random.Random(args.seed)
    task = generate_task(0, args.seed, docs=400, questions=3, confounders=2)
    env = DocumentEnv(task, tokenizer=args.tokenizer, embedder="hashing", chunk_tokens=args.chunk_tokens,
                      max_prompt_tokens=args.max_prompt_tokens, max_steps=10_000, max_answer_steps=1)
    filler = [u.text for b in task.blocks for u in b.units]
    texts = [f"{rng.choice(filler)} (note {i})" for i in range(args.atoms)]

    # split a step into its parts by timing the core's phases
    parts = {"parse": [], "tools": [], "prompt": []}
    orig_parser, orig_observe = env.parser, env._observe

    def timed_parser(text):
        t0 = time.perf_counter()
        out = orig_parser(text)
        parts["parse"].append((time.perf_counter() - t0) * 1e3)
        return out

    def timed_observe():
        t0 = time.perf_counter()
        out = orig_observe()
        parts["prompt"].append((time.perf_counter() - t0) * 1e3)
        return out

    env.parser = timed_parser
    env._observe = timed_observe

    def new_episode():
        env.reset(seed=args.seed)
        handles = env.preload(texts)
        return handles

    handles = new_episode()
    times: list[float] = []
    n = 0
    while len(times) < args.steps:
        if env.phase != "chunks":
            handles = new_episode()
        chunk = env.chunks[env.chunk_index].text.splitlines()
        fact = rng.choice([l for l in chunk if not l.startswith("[")] or ["A fact."])
        a, b = rng.sample(handles, 2)
        action = (tc("create_memory", {"content": fact}) + tc("read_memory", {"query": fact})
                  + tc("label_relation", {"new": a, "old": b, "label": "independent"})
                  + tc("write_scratchpad", {"content": f"step {n}: stored {fact[:60]}"}))
        p0, o0 = len(parts["parse"]), len(parts["prompt"])
        t0 = time.perf_counter()
        env.step(action)
        dt = (time.perf_counter() - t0) * 1e3
        n += 1
        if n > args.warmup:
            times.append(dt)
            parts["tools"].append(dt - sum(parts["parse"][p0:]) - sum(parts["prompt"][o0:]))
    env.close()
    warm = args.warmup
    out = {
        "atoms": args.atoms,
        "step_ms_median": round(_pct(times, 0.5), 3),
        "step_ms_p95": round(_pct(times, 0.95), 3),
        "steps": len(times),
        "parse_ms": round(_pct(parts["parse"][warm:], 0.5), 3),
        "tools_ms": round(_pct(parts["tools"], 0.5), 3),
        "prompt_ms": round(_pct(parts["prompt"][warm:], 0.5), 3),
        "tokenizer": env.tokens.name,
        "embedder": "hashing",
    }
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return 0
