"""Tokens the policy update forwards, padded rows against prefix-shared packing, from real step prompts.

No model is trained or run: ``--groups`` tasks are each played ``--group-size`` times (one GRPO group per
task) by a policy whose episodes differ (``--policy random``: seeded per episode, so memories, scratchpads
and results diverge; ``heuristic`` is deterministic, its group is one episode repeated). Every step
becomes a sample: its prompt is the environment's real chat messages rendered with the policy tokenizer's
chat template, its completion the action text, tokenised (cut at ``--max-completion``). Then:

* ``raw_tokens``: the samples' tokens, each forwarded whole (no padding);
* ``padded_tokens``: TRL's row path, every row padded to the widest prompt + widest completion;
* ``forwarded_tokens``: the packed path (``training/packing.py``: TRL's ``TreeRow`` prefix tries, a
  group's samples in one trie) with at most ``--max-tokens`` unique tokens per micro-batch, and the
  largest micro-batch; ``forwarded_over_raw`` is the packed path's share.

Defaults are the Qwen3-8B GRPO recipe's environment (4,096-token chunks, 16,384-token prompts, group 16)
on real 200-document HotpotQA tasks shipped with the package:

    python scripts/packing_projection.py                              # HotpotQA, 200 documents
    python scripts/packing_projection.py --tasks T.jsonl --groups 2   # any task file

Run it on two checkouts to compare prompt layouts (the numbers depend only on the prompts and the packer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=None, help="task JSONL (default: 200-document HotpotQA tasks prepared "
                                                 "from the shipped subset)")
    p.add_argument("--groups", type=int, default=2, help="tasks, one group each (default 2)")
    p.add_argument("--group-size", type=int, default=16, help="episodes per task (default 16, the recipe's G)")
    p.add_argument("--policy", choices=("random", "heuristic"), default="random")
    p.add_argument("--chunk-tokens", type=int, default=4096)
    p.add_argument("--max-prompt-tokens", type=int, default=16384)
    p.add_argument("--max-completion", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=65536, help="packed: unique tokens per micro-batch")
    p.add_argument("--max-steps", type=int, default=0, help="chunks per episode at most (0: all)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if min(args.groups, args.group_size, args.chunk_tokens, args.max_completion) < 1 or args.max_tokens < 2:
        p.error("--groups, --group-size, --chunk-tokens, --max-completion must be >= 1, --max-tokens >= 2")

    from atommem_rl.policies.heuristic import HeuristicPolicy
    from atommem_rl.policies.scripted import RandomPolicy
    from atommem_rl.rollout import run_rollouts
    from atommem_rl.tasks.schema import load_tasks
    from atommem_rl.training.grpo import step_samples
    from atommem_rl.training.packing import plan_microbatches, step_group_ids, tree_samples, unique_tokens
    from envs.tokens import cached_smollm2_tokenizer

    tok = cached_smollm2_tokenizer()  # the policy tokenizer of the CPU runs (Qwen3's is not available offline)
    if args.tasks is None:
        from atommem_rl.data import benchmark_file
        from atommem_rl.tasks.prepare import prepare_hotpotqa

        tasks = prepare_hotpotqa(str(benchmark_file("hotpotqa")), docs=200, questions=(1, 10), seed=args.seed)
    else:
        tasks = load_tasks(args.tasks)
    tasks = tasks[: args.groups]
    if len(tasks) < args.groups:
        p.error(f"{args.tasks or 'hotpotqa'} has {len(tasks)} tasks, fewer than --groups {args.groups}")
    policy = RandomPolicy(seed=args.seed) if args.policy == "random" else HeuristicPolicy()
    env = {"tokenizer": tok, "chunk_tokens": args.chunk_tokens, "max_prompt_tokens": args.max_prompt_tokens,
           "retrieval_k": 6, "read_budget": 3, "answer_read_budget": 3, "embedder": "hashing"}
    if args.max_steps:
        env["max_steps"] = args.max_steps
    t0 = time.perf_counter()
    copies = [t for t in tasks for _ in range(args.group_size)]  # episode k is task k // group_size
    trajs = sorted(run_rollouts(copies, policy, env, batch_size=len(copies), seed=args.seed),
                   key=lambda r: r["key"])
    episodes = []
    for r in trajs:
        steps = []
        for s in r["steps"]:
            prompt = tok.encode(tok.apply_chat_template(s["prompt"], tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False)
            steps.append((prompt, tok.encode(s["completion"], add_special_tokens=False)[: args.max_completion], None))
        episodes.append(steps)
    samples = step_samples(episodes, [1.0] * len(episodes))
    trees = tree_samples(samples, step_group_ids(episodes, args.group_size))
    rows = plan_microbatches(trees, args.max_tokens)
    raw = sum(len(s[0]) + len(s[1]) for s in samples)
    padded = len(samples) * (max(len(s[0]) for s in samples) + max(len(s[1]) for s in samples))
    forwarded = [unique_tokens(r) for r in rows]
    print(json.dumps({
        "tasks": args.tasks or "hotpotqa (shipped subset), 200 documents, 1-10 questions", "groups": args.groups,
        "group_size": args.group_size, "policy": args.policy, "samples": len(samples),
        "steps_per_episode_median": statistics.median(len(e) for e in episodes),
        "prompt_tokens_median": statistics.median(len(s[0]) for s in samples),
        "raw_tokens": raw, "padded_tokens": padded, "forwarded_tokens": sum(forwarded),
        "forwarded_over_raw": round(sum(forwarded) / raw, 4), "micro_batches": len(rows),
        "largest_microbatch_tokens": max(forwarded), "max_tokens_per_microbatch": args.max_tokens,
        "rollout_s": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
