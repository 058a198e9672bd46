"""``atommem bench env``: environment overhead per step (parsing, memory operations, prompt assembly).

Method. One synthetic document task is opened in ``DocumentEnv`` with the hashing embedder (so model
inference is out of the figure), the policy's real tokenizer (SmolLM2 by default) and in-memory
Chroma; ``--atoms`` atoms are preloaded into its store. Each measured step is a typical action: one
``create_memory`` with a fact of the current chunk, one ``read_memory``, one ``label_relation``
between two existing atoms, and a scratchpad rewrite. The time of ``env.step`` is measured with
``perf_counter`` after ``--warmup`` unmeasured steps; a new episode (with the same preload) starts
when one ends. Reported: median and p95 milliseconds, and the split of a step into its parts
(``parse_ms``, ``tools_ms``, ``prompt_ms``; medians).

With the in-memory backend the store batches writes per Chroma call (``write_behind``, 64) and
answers unfiltered reads of up to 8192 atoms by exact cosine in process (``exact_below``), and the
prompt is counted from memoised piece counts (``envs/tokens.py``). With ``--compare-write-through``
a second env whose every memory operation is a Chroma call (write-through, Chroma reads) takes the
same actions, the two alternating step by step, and the ratio of their medians is reported: the
figure that survives a loaded machine.

    atommem bench env --atoms 1000 --steps 200 --json [--compare-write-through]
"""

from __future__ import annotations

import argparse
import json

from ..commands import at_most, seed_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--atoms", type=at_most(10**6, 2), default=1000,
                        help="atoms preloaded into memory, at least 2 (relations need a pair; default 1000)")
    parser.add_argument("--steps", type=at_most(10**6), default=200, help="measured steps (default 200)")
    parser.add_argument("--warmup", type=at_most(10**6, 0), default=10, help="unmeasured steps first (default 10)")
    parser.add_argument("--tokenizer", default=None, help="policy tokenizer (default SmolLM2)")
    parser.add_argument("--chunk-tokens", type=at_most(10**6), default=512)
    parser.add_argument("--max-prompt-tokens", type=at_most(10**7), default=4096)
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--write-behind", type=at_most(10**6, 0), default=None,
                        help="writes batched per Chroma call (default: the env's, 64 in memory; 0 = write-through)")
    parser.add_argument("--exact-below", type=at_most(10**8, 0), default=None,
                        help="exact in-process reads up to this many atoms (default: the env's, 8192 in memory; 0 = Chroma)")
    parser.add_argument("--compare-write-through", action="store_true",
                        help="also step an env whose every memory operation is a Chroma call (write-through, "
                             "Chroma reads) with the same actions, alternating, and report the ratio")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


class _Timed:
    """One env plus the timing of its parts (parser and prompt assembly wrapped in place)."""

    def __init__(self, env, texts, seed):
        import time

        self.env, self.texts, self.seed = env, texts, seed
        self.times: list[float] = []
        self.parts = {"parse": [], "tools": [], "prompt": []}
        orig_parser, orig_observe = env.parser, env._observe

        def timed_parser(text):
            t0 = time.perf_counter()
            out = orig_parser(text)
            self.parts["parse"].append((time.perf_counter() - t0) * 1e3)
            return out

        def timed_observe():
            t0 = time.perf_counter()
            out = orig_observe()
            self.parts["prompt"].append((time.perf_counter() - t0) * 1e3)
            return out

        env.parser, env._observe = timed_parser, timed_observe
        self.new_episode()

    def new_episode(self):
        self.env.reset(seed=self.seed)
        self.handles = self.env.preload(self.texts)

    def step(self, action, measured: bool) -> None:
        import time

        p0, o0 = len(self.parts["parse"]), len(self.parts["prompt"])
        t0 = time.perf_counter()
        self.env.step(action)
        dt = (time.perf_counter() - t0) * 1e3
        if measured:
            self.times.append(dt)
            self.parts["tools"].append(dt - sum(self.parts["parse"][p0:]) - sum(self.parts["prompt"][o0:]))
        else:  # warm-up: keep the part lists aligned with measured steps only
            del self.parts["parse"][p0:], self.parts["prompt"][o0:]

    def summary(self) -> dict:
        return {
            "step_ms_median": round(_pct(self.times, 0.5), 3),
            "step_ms_p95": round(_pct(self.times, 0.95), 3),
            "parse_ms": round(_pct(self.parts["parse"], 0.5), 3),
            "tools_ms": round(_pct(self.parts["tools"], 0.5), 3),
            "prompt_ms": round(_pct(self.parts["prompt"], 0.5), 3),
        }


def main(args) -> int:
    import random

    from atommem_rl.tasks.synth import generate_task
    from envs.documents import DocumentEnv
    from envs.parser import format_tool_call as tc

    rng = random.Random(args.seed)
    task = generate_task(0, args.seed, docs=400, questions=3, confounders=2)
    filler = [u.text for b in task.blocks for u in b.units]
    texts = [f"{rng.choice(filler)} (note {i})" for i in range(args.atoms)]

    def make(write_behind, exact_below):
        env = DocumentEnv(task, tokenizer=args.tokenizer, embedder="hashing", chunk_tokens=args.chunk_tokens,
                          max_prompt_tokens=args.max_prompt_tokens, max_steps=10_000, max_answer_steps=1,
                          write_behind=write_behind, exact_below=exact_below)
        return _Timed(env, texts, args.seed)

    runs = [make(args.write_behind, args.exact_below)] + ([make(0, 0)] if args.compare_write_through else [])
    main_env = runs[0].env
    n = 0
    while len(runs[0].times) < args.steps:
        if main_env.phase != "chunks":
            for r in runs:
                r.new_episode()
        chunk = main_env.chunks[main_env.chunk_index].text.splitlines()
        fact = rng.choice([l for l in chunk if not l.startswith("[")] or ["A fact."])
        a, b = rng.sample(runs[0].handles, 2)
        action = (tc("create_memory", {"content": fact}) + tc("read_memory", {"query": fact})
                  + tc("label_relation", {"new": a, "old": b, "label": "independent"})
                  + tc("write_scratchpad", {"content": f"step {n}: stored {fact[:60]}"}))
        n += 1
        for r in (runs if n % 2 else runs[::-1]):  # alternate which env goes first
            r.step(action, measured=n > args.warmup)
    for r in runs:
        r.env.close()
    out = {"atoms": args.atoms, "steps": len(runs[0].times), **runs[0].summary(),
           "write_behind": main_env._write_behind(), "exact_below": main_env._exact_below(),
           "tokenizer": main_env.tokens.name, "embedder": "hashing"}
    if args.compare_write_through:
        wt = runs[1].summary()
        out["write_through"] = wt
        out["ratio_write_through_over_default"] = round(wt["step_ms_median"] / out["step_ms_median"], 2)
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return 0
