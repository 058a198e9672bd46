"""Shared-prefix generation against Hugging Face's left-padded ``generate`` (a benchmark, not a test).

Two batches shaped like the step prompts of the quickstart setting (SmolLM2-135M, ~700-token system prompt):
``group``, a GRPO first round (all rows one prompt); ``mixed``, an evaluation round (rows share only the
system prompt, their own parts 400-660 tokens). Each case alternates the plain call and the shared one
``--repeats`` times in one process (greedy, fp32) and prints one JSON line with the medians, the speedup and
the largest score difference. Random token ids stand in for text: the cost depends on lengths only.

    python scripts/bench_shared_prefix.py [--model DIR] [--rows 8] [--new-tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from atommem_rl.inference.shared_prefix import generate_shared_prefix
    from atommem_rl.models import BASE_MODEL_DIR, prepare_base_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(BASE_MODEL_DIR))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=700)
    args = ap.parse_args()
    if args.model == str(BASE_MODEL_DIR):
        prepare_base_model(BASE_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    system = torch.randint(100, 40000, (args.system_tokens,), generator=g).tolist()
    own = torch.randint(100, 40000, (600,), generator=g).tolist()
    cases = {"group": [system + own] * args.rows,
             "mixed": [system + torch.randint(100, 40000, (400 + 37 * i,), generator=g).tolist()
                       for i in range(args.rows)]}
    kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
              output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    for name, rows in cases.items():
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        times: dict[str, list[float]] = {"plain": [], "shared": []}
        diff, stats = 0.0, {}
        for _ in range(args.repeats):
            with torch.no_grad():
                t = time.perf_counter()
                a = model.generate(input_ids=ids, attention_mask=mask, **kw)
                times["plain"].append(time.perf_counter() - t)
                t = time.perf_counter()
                b = generate_shared_prefix(model, ids, mask, stats=stats, **kw)
                times["shared"].append(time.perf_counter() - t)
            diff = max(diff, max((x - y).abs().max().item() for x, y in zip(a.scores, b.scores)))
            same = torch.equal(a.sequences[:, width:], b.sequences[:, width:])
        med = {k: statistics.median(v) for k, v in times.items()}
        print(json.dumps({"case": name, "rows": len(rows), "prompt_tokens": stats["prompt_tokens"],
                          "prefilled_tokens": stats["forwarded_prompt_tokens"], "new_tokens": args.new_tokens,
                          "plain_s": round(med["plain"], 2), "shared_s": round(med["shared"], 2),
                          "speedup": round(med["plain"] / med["shared"], 2), "max_score_diff": diff,
                          "same_tokens": same, "repeats": args.repeats, "threads": torch.get_num_threads()}),
              flush=True)


if __name__ == "__main__":
    main()
