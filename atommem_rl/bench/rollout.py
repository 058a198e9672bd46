"""``atommem bench rollout``: rollout throughput of the model policy, Hugging Face generate against vLLM.

Method. ``--tasks`` synthetic document tasks (``--docs`` documents, ``--questions`` questions each)
run as episodes through :func:`atommem_rl.rollout.run_rollouts` with the model policy, all episodes
stepped together (one generation call per step, ``--batch-size`` episodes at most), greedy decoding
(``--temperature 0``) and at most ``--max-new-tokens`` per action. Each backend (``--backends``;
default ``hf`` plus ``vllm`` when it imports) loads the same model folder (default: SmolLM2-135M-
Instruct, ``models.prepare_base_model``) in the same dtype, runs one unmeasured warm-up generation,
then the same task set ``--repeats`` times. Per run:

* ``episodes_per_s`` = episodes / wall time of ``run_rollouts``
* ``completion_tokens_per_s`` = completion tokens / wall time (``generate_tokens_per_s``: per second
  of generation calls only)
* ``env_share`` = 1 - (time inside ``policy.act``) / wall time: everything that is not generation
  (environment steps, memory operations, prompt assembly, episode open/close); goal < 0.05
* ``prompt_tokens_per_task`` and ``completion_tokens_per_task`` (prompt tokens are re-sent each step)
* ``prefix_cache_hit_rate`` (vLLM): prompt tokens served from vLLM's prefix cache / prompt tokens

Reported per backend: the median over the repeats of each figure (and every run's), the model load
time, and ``speedup`` (vLLM over HF completion tokens/s) when both ran. Both backends decode
greedily from identical prompt tokens, so their completions (and token counts) mostly agree.

    atommem bench rollout --tasks 4 --repeats 3 --json
    atommem bench rollout --backends hf --model checkpoints/base/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from ..commands import at_most, nonneg_float, seed_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct base)")
    parser.add_argument("--backends", default=None,
                        help="comma-separated, from hf,vllm (default: hf, plus vllm when it imports)")
    parser.add_argument("--tasks", type=at_most(10**5), default=4, help="synthetic document tasks = episodes per run (default 4)")
    parser.add_argument("--docs", type=at_most(10**4), default=4, help="documents per task (default 4)")
    parser.add_argument("--questions", type=at_most(100), default=1, help="questions per task (default 1)")
    parser.add_argument("--batch-size", type=at_most(10**4), default=8, help="episodes stepped together (default 8)")
    parser.add_argument("--max-new-tokens", type=at_most(10**5), default=64, help="tokens per action at most (default 64)")
    parser.add_argument("--temperature", type=nonneg_float, default=0.0)
    parser.add_argument("--chunk-tokens", type=at_most(10**6), default=256)
    parser.add_argument("--max-prompt-tokens", type=at_most(10**7), default=2048)
    parser.add_argument("--repeats", type=at_most(1000), default=3, help="measured runs per backend (default 3)")
    parser.add_argument("--dtype", default="float32", help="model dtype for both backends (default float32)")
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def _backends(spec: str | None) -> list[str]:
    from atommem_rl.inference.vllm_engine import vllm_available

    if spec is None:
        return ["hf"] + (["vllm"] if vllm_available() else [])
    names = [b.strip() for b in spec.split(",") if b.strip()]
    bad = [b for b in names if b not in ("hf", "vllm")]
    if bad or not names:
        raise ValueError(f"--backends takes hf and/or vllm, got {spec!r}")
    if "vllm" in names and not vllm_available():
        raise ValueError("--backends vllm: vllm is not importable here (CPU build: bash scripts/setup_vllm.sh)")
    return names


class _Timed:
    """Delegates to the policy and adds up the wall time of its ``act`` calls."""

    def __init__(self, policy):
        self.policy, self.name, self.seconds = policy, policy.name, 0.0

    def start(self, key, task):
        self.policy.start(key, task)

    def end(self, key):
        self.policy.end(key)

    def act(self, batch):
        t0 = time.perf_counter()
        try:
            return self.policy.act(batch)
        finally:
            self.seconds += time.perf_counter() - t0


def measure(policy, tasks, env_config: dict, batch_size: int, seed: int) -> dict:
    """One run of all tasks; the figures of the module docstring."""
    from atommem_rl.rollout import run_rollouts

    timed = _Timed(policy)
    before = dict(policy.tokens)
    cached0 = policy.cached_prompt_tokens
    gen0 = policy.generate_seconds
    t0 = time.perf_counter()
    trajs = run_rollouts(tasks, timed, env_config, batch_size=batch_size, seed=seed, record_prompts=False)
    wall = time.perf_counter() - t0
    prompt = policy.tokens["prompt"] - before["prompt"]
    completion = policy.tokens["completion"] - before["completion"]
    gen = policy.generate_seconds - gen0
    n = len(trajs)
    return {
        "wall_s": wall, "episodes": n, "steps": sum(len(t["steps"]) for t in trajs),
        "crashes": sum(1 for t in trajs if t.get("crashed")),
        "episodes_per_s": n / wall, "completion_tokens_per_s": completion / wall,
        "generate_tokens_per_s": completion / gen if gen > 0 else None,
        "env_share": max(0.0, 1.0 - timed.seconds / wall),
        "prompt_tokens_per_task": prompt / n, "completion_tokens_per_task": completion / n,
        # vLLM: share of prompt tokens served from its prefix cache (None for HF generate, which has none)
        "prefix_cache_hit_rate": (policy.cached_prompt_tokens - cached0) / prompt
        if policy.backend == "vllm" and prompt else None,
    }


def _median_figures(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float)) and runs[0][k] is not None]
    return {k: round(statistics.median(r[k] for r in runs), 4) for k in keys}


def bench_backend(backend: str, args, model_path: str, tasks, env_config: dict) -> dict:
    from atommem_rl.policies.model_policy import ModelPolicy

    t0 = time.perf_counter()
    policy = ModelPolicy(model_path, backend=backend, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, dtype=args.dtype, seed=args.seed)
    load_s = time.perf_counter() - t0
    try:
        from atommem_rl.rollout import run_rollouts

        # warm-up (not measured): one episode's first steps pay allocator and kernel warm-up
        run_rollouts(tasks[:1], policy, env_config, batch_size=1, seed=args.seed, record_prompts=False)
        runs = []
        for i in range(args.repeats):
            runs.append(measure(policy, tasks, env_config, args.batch_size, args.seed))
            print(f"bench rollout: {backend} run {i + 1}/{args.repeats}: {runs[-1]['wall_s']:.1f} s, "
                  f"{runs[-1]['completion_tokens_per_s']:.1f} completion tokens/s", file=sys.stderr, flush=True)
    finally:
        close = getattr(policy, "close", None)
        if close is not None:
            close()
    return {"backend": backend, "load_s": round(load_s, 2), "median": _median_figures(runs),
            "runs": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in runs]}


def main(args) -> int:
    from atommem_rl.policies.model_policy import default_model_path
    from atommem_rl.tasks.synth import generate_tasks

    # vLLM logs to stdout by default: keep stdout for the figures (set before vllm is imported)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if args.tasks < 1 or args.repeats < 1 or args.batch_size < 1 or args.max_new_tokens < 1:
        raise ValueError("--tasks, --repeats, --batch-size and --max-new-tokens must be at least 1")
    backends = _backends(args.backends)
    model_path = os.path.abspath(args.model) if args.model else default_model_path()
    from atommem_rl.models import check_checkpoint

    check_checkpoint(model_path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    tasks = generate_tasks(args.tasks, seed=args.seed, docs=args.docs, questions=args.questions, confounders=1)
    env_config = {"tokenizer": tok, "chunk_tokens": args.chunk_tokens, "max_prompt_tokens": args.max_prompt_tokens,
                  "embedder": "hashing", "max_answer_steps": 1}
    results = [bench_backend(b, args, model_path, tasks, env_config) for b in backends]
    out = {"model": model_path, "dtype": args.dtype, "tasks": args.tasks, "docs": args.docs,
           "questions": args.questions, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
           "torch_threads": __import__("torch").get_num_threads(), "load_average": os.getloadavg(),
           "backends": results}
    by = {r["backend"]: r["median"] for r in results}
    if "hf" in by and "vllm" in by and by["hf"]["completion_tokens_per_s"] > 0:
        out["speedup_vllm_over_hf"] = round(by["vllm"]["completion_tokens_per_s"] / by["hf"]["completion_tokens_per_s"], 2)
    if args.json:
        print(json.dumps(out))
    else:
        for r in results:
            m = r["median"]
            print(f"{r['backend']}: {m['episodes_per_s']:.3f} episodes/s, {m['completion_tokens_per_s']:.1f} "
                  f"completion tokens/s (generation only {m.get('generate_tokens_per_s', 0):.1f}), env share "
                  f"{m['env_share']:.3f}, tokens/task prompt {m['prompt_tokens_per_task']:.0f} completion "
                  f"{m['completion_tokens_per_task']:.0f}, load {r['load_s']} s"
                  + (f", prefix cache hit rate {m['prefix_cache_hit_rate']:.2f}" if "prefix_cache_hit_rate" in m else ""))
        if "speedup_vllm_over_hf" in out:
            print(f"vLLM / HF completion tokens/s: {out['speedup_vllm_over_hf']}")
    return 0
