"""``atommem bench decode --finished N``: a greedy batch whose rows end at different steps, decoded by
``generate`` (every row computed until the batch's longest ends, then cut: ``HFEngine(drop_finished=False)``)
against :func:`~atommem_rl.inference.compact_decode.greedy_decode` (rows leave the batch as they end), with
the shared prefix's key/value cache repeated to every row (``drop_finished``) and kept once
(``prefix_kv_once``, cascade_attention.py: the evaluation engine's default). All three on ``sdpa_grouped``
attention (``HFEngine`` switches the model to it).

Method. The rows of ``atommem bench decode`` (``--rows`` prompts of about ``--context`` tokens sharing all
but their last tokens, prefilled once), each with its own token limit, spread evenly from N/8 to N in a
seeded order: a row keeps 56% of the N tokens on average, where the quickstart's evaluation batches kept
47-63% (trained checkpoints, 32 rows, N = 224). The limits end the rows (random prompts seldom reach an end
token), as end tokens do in a real batch. ``--repeats`` rounds alternating the two, one process; medians.
Printed (``--json``)::

    {"rows", "context", "new_tokens", "dtype", "kept_share", "generate_s", "drop_finished_s", "prefix_kv_once_s",
     "speedup" (generate / drop_finished), "speedup_prefix_kv_once" (drop_finished / prefix_kv_once), "same_tokens",
     "same_tokens_prefix_kv_once", "prefix_kv_shared", "row_steps": {"generate", "drop_finished"}, "drops", "runs"}

    atommem bench decode --finished 224 --json          # SmolLM2-135M, 32 rows, 1.4K context, fp32
"""

from __future__ import annotations

import statistics
import sys
import time


def run(args, path: str, dtype, rows: list[list[int]]) -> dict:
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..inference.compact_decode import greedy_decode
    from ..inference.hf_engine import HFEngine

    n = args.finished
    limits = [max(1, round(n / 8 + (n - n / 8) * i / max(1, len(rows) - 1))) for i in range(len(rows))]
    random.Random(args.seed).shuffle(limits)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(path)
    plain = HFEngine(model, tok, drop_finished=False)
    stops, stats = plain.stops, {}

    def dropping(share: bool):  # share: what HFEngine runs for a greedy call by default, with its counts
        def call():
            with torch.no_grad():
                return greedy_decode(model, rows, limits, stops, stats=stats, share_prefix_kv=share)
        return call

    runs = {"generate": lambda: [c.token_ids for c in plain.generate(rows, limits)], "drop_finished": dropping(False),
            "prefix_kv_once": dropping(True)}
    seconds: dict[str, list[float]] = {k: [] for k in runs}
    tokens = {}
    for r in range(args.repeats):
        for name, call in runs.items():
            t = time.perf_counter()
            tokens[name] = call()
            seconds[name].append(time.perf_counter() - t)
        print(f"bench decode --finished: round {r + 1}/{args.repeats}: "
              + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in seconds.items()), file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    return {"rows": len(rows), "context": max(map(len, rows)), "new_tokens": n, "dtype": str(dtype).split(".")[-1],
            "kept_share": round(sum(limits) / (len(rows) * max(limits)), 3),
            "generate_s": round(med["generate"], 2), "drop_finished_s": round(med["drop_finished"], 2),
            "prefix_kv_once_s": round(med["prefix_kv_once"], 2),
            "speedup": round(med["generate"] / med["drop_finished"], 2),
            "speedup_prefix_kv_once": round(med["drop_finished"] / med["prefix_kv_once"], 2),
            "same_tokens": tokens["generate"] == tokens["drop_finished"],
            "same_tokens_prefix_kv_once": tokens["generate"] == tokens["prefix_kv_once"],
            "prefix_kv_shared": stats.get("prefix_kv_shared"),
            "row_steps": {"generate": len(rows) * max(limits), "drop_finished": stats["row_steps"]},
            "drops": stats["drops"], "runs": {k: [round(x, 2) for x in v] for k, v in seconds.items()}}
