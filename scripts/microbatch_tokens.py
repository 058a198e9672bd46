"""Tokens in the largest policy-update micro-batch of TRL's padded row path, from real trajectories.

How the step-wise GRPO trainer lays a generation batch out today (max_tokens_per_microbatch 0): every
step sample of a process's episodes is one row; rows are left-padded to the widest prompt and
right-padded to the widest completion of the whole local generation batch, then cut by row counts into
``steps_per_generation`` micro-batches, each one forward/backward. So the largest micro-batch holds
ceil(rows / steps_per_generation) x (widest prompt + widest completion) tokens, padding included.

The local generation batch here is ``per_device_train_batch_size x steps_per_generation`` episodes, i.e.
that many / ``num_generations`` tasks, each with ``num_generations`` episodes. The trajectories come from
a deterministic policy (``--policy heuristic``), so a task's group is its one episode repeated: the row
count and widths are those of a group whose episodes take the same number of steps.

    atommem data prepare --source hotpotqa --path HOTPOT.json --docs 200 --questions 1-10 --out T.jsonl
    atommem rollout --tasks T.jsonl --policy heuristic --limit 6 --chunk-tokens 4096 \\
        --max-prompt-tokens 16384 --retrieval-k 6 --read-budget 3 --answer-read-budget 3 --out R.jsonl
    python scripts/microbatch_tokens.py R.jsonl --recipe recipes/qwen3_8b/grpo.yaml
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trajectories", help="atommem rollout --out file (JSONL, one episode per line)")
    p.add_argument("--recipe", default="recipes/qwen3_8b/grpo.yaml", help="GRPO recipe whose batch settings apply")
    p.add_argument("--tokenizer", default=None, help="tokenizer for the completions (default: the rollout's, SmolLM2)")
    args = p.parse_args()

    import yaml

    from envs.tokens import load_tokenizer

    recipe = yaml.safe_load(open(args.recipe))
    per_device = int(recipe.get("per_device_train_batch_size", 1))
    spg = int(recipe.get("steps_per_generation") or recipe.get("gradient_accumulation_steps", 1))
    group = int(recipe["num_generations"])
    max_completion = int(recipe["max_completion_length"])
    tasks_per_batch = max(1, per_device * spg // group)
    tok = load_tokenizer(args.tokenizer)

    episodes = []  # per task: [(prompt tokens, completion tokens)] per step
    for line in open(args.trajectories, encoding="utf-8"):
        ep = json.loads(line)
        steps = [(s["prompt_tokens"], min(max_completion, len(tok.encode(s["completion"]))))
                 for s in ep["steps"] if s.get("prompt_tokens")]
        episodes.append((ep["task_id"], steps))

    worst = None
    for combo in itertools.combinations(range(len(episodes)), min(tasks_per_batch, len(episodes))):
        rows = [s for i in combo for s in episodes[i][1] for _ in range(group)]
        width = max(r[0] for r in rows) + max(r[1] for r in rows)
        per_micro = math.ceil(len(rows) / spg)
        real = [sum(a + b for a, b in rows[k:k + per_micro]) for k in range(0, len(rows), per_micro)]
        fig = {"tasks": [episodes[i][0] for i in combo], "rows": len(rows), "rows_per_microbatch": per_micro,
               "widest_prompt": max(r[0] for r in rows), "widest_completion": max(r[1] for r in rows),
               "largest_microbatch_tokens": per_micro * width, "largest_microbatch_unpadded": max(real),
               # all micro-batches: tokens forwarded (padding included) per token of the samples themselves
               "padded_over_unpadded": round(per_micro * width * len(real) / sum(real), 2)}
        if worst is None or fig["largest_microbatch_tokens"] > worst["largest_microbatch_tokens"]:
            worst = fig
    steps = [len(s) for _, s in episodes]
    prompts = [a for _, s in episodes for a, _ in s]
    print(json.dumps({"recipe": args.recipe, "episodes_per_process": per_device * spg, "group": group,
                      "tasks_per_process": tasks_per_batch, "micro_batches": spg, "trajectories": len(episodes),
                      "steps_per_episode_median": statistics.median(steps), "prompt_tokens_max": max(prompts),
                      "prompt_tokens_median": statistics.median(prompts), "worst_local_batch": worst}))


if __name__ == "__main__":
    main()
