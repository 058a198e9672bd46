"""``atommem bench extractor``: fact-level precision/recall of an extractor on held-out synthetic dialogues.

Method. ``--tasks`` synthetic dialogue tasks are generated with ``--seed`` (1000 by default; training
pairs use seed 0, so names, places and dates differ), with half of the leading months made relative
to the session date (``extraction.gold.relativise``). Every window goes through the extractor
(``extraction.extractor``; greedy, bounded retries) on the chosen backend; predictions are matched to
the gold atoms one-to-one by token F1 >= ``--min-f1`` (``extraction.gold.match``). Reported: micro
precision, recall and F1, time-anchor and source-turn accuracy of matched facts, the extractor's
counters (calls, retries, local repairs, unreadable replies, invalid facts skipped) and tokens.

    atommem bench extractor --model checkpoints/base/smollm2-135m-instruct --json     # before SFT
    atommem bench extractor --model checkpoints/extractor/sft --json                  # after SFT
"""

from __future__ import annotations

import argparse
import json
import sys

from ..commands import at_most, seed_int, unit_float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: the quickstart base model)")
    parser.add_argument("--backend", choices=["hf", "vllm", "openai"], default="hf")
    parser.add_argument("--base-url", default=None)
    parser.add_argument("--model-name", default=None)
    parser.add_argument("--tasks", type=at_most(10**5), default=6, help="held-out tasks (default 6)")
    parser.add_argument("--docs", type=at_most(10**4), default=6, help="sessions per task (default 6)")
    parser.add_argument("--seed", type=seed_int, default=1000)
    parser.add_argument("--min-f1", type=unit_float, default=0.6)
    parser.add_argument("--max-new-tokens", type=at_most(10**5), default=384)
    parser.add_argument("--max-retries", type=at_most(100, 0), default=1)
    parser.add_argument("--gen-batch-size", type=at_most(10**4), default=8)
    parser.add_argument("--samples", default=None, help="write every window's prediction and gold to this JSONL")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def main(args) -> int:
    import time

    from atommem_rl.inference.chat_backends import make_backend
    from atommem_rl.extraction.extractor import ExtractSettings, add_stats, extract_tasks
    from atommem_rl.extraction.gold import score, synth_tasks, window_gold

    tasks, golds = synth_tasks(args.tasks, args.seed, args.docs)
    backend = make_backend(args.backend, args.model, base_url=args.base_url, model_name=args.model_name,
                           batch_size=args.gen_batch_size)
    s = ExtractSettings(max_new_tokens=args.max_new_tokens, max_retries=args.max_retries)
    t0 = time.perf_counter()
    print(f"bench extractor: {len(tasks)} tasks x {args.docs} sessions through {backend.model_name} ({args.backend}, "
          f"batches of {args.gen_batch_size}, up to {args.max_new_tokens} tokens per reply)", file=sys.stderr, flush=True)
    results = extract_tasks(tasks, backend, s)
    seconds = time.perf_counter() - t0
    print(f"bench extractor: extracted in {seconds:.0f} s; scoring", file=sys.stderr, flush=True)
    figures = score(results, golds, args.min_f1)
    stats: dict[str, int] = {}
    for res in results:
        add_stats(stats, res)
    per_task = [backend.take_usage(("extract", i)) for i in range(len(tasks))]  # take_usage pops: once per task
    usage = {k: sum(u[k] for u in per_task) for k in ("calls", "prompt_tokens", "completion_tokens", "cut_prompts")}
    out = {"model": backend.model_name, "tasks": len(tasks), "seed": args.seed, "docs": args.docs, **figures,
           "extractor": stats, "usage": usage, "seconds": round(seconds, 1)}
    if args.samples:
        with open(args.samples, "w", encoding="utf-8") as fh:
            for res, gold in zip(results, golds):
                for r in res:
                    fh.write(json.dumps({"window": r.window.text, "replies": r.replies,
                                         "facts": [f.to_dict() for f in r.facts],
                                         "gold": [g.to_dict() for g in window_gold(r.window, gold)]}) + "\n")
    if args.json:
        print(json.dumps(out, default=str))
    else:
        print(f"P {figures['precision']:.3f}  R {figures['recall']:.3f}  F1 {figures['f1']:.3f}  "
              f"({figures['matched']} of {figures['predicted']} predicted, {figures['gold']} gold)  {stats}")
    return 0
