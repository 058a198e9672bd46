"""``atommem bench decode``: a Hugging Face decode step, before and after the two decode levers.

Variants: ``sdpa`` (transformers' attention, ``DynamicCache``: what ``generate`` does by default),
``grouped`` (``sdpa_grouped`` attention, ``inference/grouped_attention.py``: no per-head key/value copies) and
``grouped_buffered`` (the same with ``BufferedCache``, ``inference/buffered_cache.py``: no cache
concatenation per step; what the evaluation engine and the rollouts now run).

Method. ``--rows`` left-padded prompts of about ``--context`` tokens (random token ids: the cost depends on
lengths only) that share all but their last ``2 * i`` tokens, as an evaluation or GRPO round's rows share
their system prompt and chunk; the shared part is prefilled once (``inference/shared_prefix.py``, as the
evaluation engine and the rollouts do), so the benchmark's time goes to decoding. For each variant in
turn, ``--repeats`` rounds alternating, one process: ``generate`` of 1 token and of
``--new-tokens`` tokens (greedy, ``min_new_tokens`` so every row decodes every step); a decode step's time
is their difference over ``new_tokens - 1``. Medians are reported, with each variant's speedup over ``sdpa``
and, against ``sdpa``, whether its tokens are the same and the largest difference of a step's finite scores.

``--same-prompt``: every row one prompt instead (a GRPO group's first round: no padding, no attention mask).
``--dtype``: the weights' dtype (float32, what evaluation loads; bfloat16 halves the cache's bytes).
``--autocast``: fp32 weights with every ``forward`` wrapped in bf16 autocast, as accelerate wraps a model
trained with ``bf16: true`` (the GRPO rollouts of a bf16 recipe), plus a fourth variant,
``grouped_buffered_cast_once``: the same inside one outer autocast context per ``generate`` call
(``training/rounds.generation_autocast``), so weights are cast once per call instead of once per step.
Printed (``--json``)::

    {"rows", "context", "new_tokens", "dtype", "kv_groups", "sdpa_ms", "grouped_ms", "grouped_buffered_ms",
     "speedup" (the last variant over sdpa), "same_tokens", "max_score_diff", "variants": {...}}

    atommem bench decode --json                          # SmolLM2-135M, 32 rows, 1.4K context, fp32
    atommem bench decode --rows 8 --autocast --json      # a bf16 recipe's GRPO rollout
    atommem bench decode --tiny --json                   # seconds: a random-weight tiny Llama (CI)
    atommem bench decode --finished 224 --json           # rows ending at different steps (decode_finished.py)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

from ..commands import at_most, seed_int

VARIANTS = {"sdpa": ("sdpa", False), "grouped": ("sdpa_grouped", False), "grouped_buffered": ("sdpa_grouped", True)}
CAST_ONCE = "grouped_buffered_cast_once"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct base)")
    parser.add_argument("--tiny", action="store_true", help="a random-weight tiny Llama instead (CI)")
    parser.add_argument("--rows", type=at_most(4096), default=32, help="rows of the batch (default 32)")
    parser.add_argument("--context", type=at_most(10**6, 16), default=1400,
                        help="prompt tokens of the longest row (default 1400)")
    parser.add_argument("--new-tokens", type=at_most(10**5, 2), default=9, help="tokens decoded (default 9)")
    parser.add_argument("--repeats", type=at_most(1000), default=3, help="rounds of each variant (default 3)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--same-prompt", action="store_true",
                        help="every row the same prompt (a GRPO group's first round: no padding, so no attention mask)")
    parser.add_argument("--autocast", action="store_true",
                        help="fp32 weights, forward in bf16 autocast as accelerate wraps it; adds grouped_buffered_cast_once")
    parser.add_argument("--finished", type=at_most(10**5, 2), default=None, metavar="N",
                        help="instead: rows ending after N/8..N tokens, generate against dropping ended rows")
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def load(path: str, attn: str, dtype, autocast: bool = False):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn).eval()
    if autocast:  # as accelerate's prepare() wraps a bf16 model's forward (trainable weights: requires_grad)
        model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    return model


def main(args: argparse.Namespace) -> None:
    import torch

    from ..inference.grouped_attention import register
    from ..inference.shared_prefix import generate_shared_prefix
    from ..models import BASE_MODEL_DIR, prepare_base_model, tiny_model

    if args.finished and args.autocast:
        raise SystemExit("bench decode: --finished times the evaluation engine, which has no --autocast here")
    register()
    if args.tiny:
        path = str(tiny_model(tempfile.mkdtemp(prefix="bench-decode-") + "/m", heads=4, kv_heads=2))
    else:
        path = args.model or str(prepare_base_model(BASE_MODEL_DIR))
    if args.autocast and args.dtype != "float32":
        raise SystemExit("bench decode: --autocast runs fp32 weights; leave --dtype at float32")
    dtype = getattr(torch, args.dtype)
    variants_run = {**VARIANTS, **({CAST_ONCE: ("sdpa_grouped", True)} if args.autocast else {})}
    g = torch.Generator().manual_seed(args.seed)
    shared = torch.randint(100, 1000 if args.tiny else 40000, (args.context,), generator=g).tolist()
    if args.same_prompt:
        rows = [shared] * args.rows
    else:
        rows = [shared[: max(1, args.context - 2 * i)] + [500 + i] for i in range(args.rows)]
    if args.finished:
        from .decode_finished import run

        out = run(args, path, dtype, rows)
        print(json.dumps(out) if args.json else
              f"{out['rows']} rows ending after {args.finished // 8}-{args.finished} tokens: generate "
              f"{out['generate_s']} s, dropping ended rows {out['drop_finished_s']} s ({out['speedup']}x), and with "
              f"the prefix's cache kept once {out['prefix_kv_once_s']} s ({out['speedup_prefix_kv_once']}x more); "
              f"same tokens {out['same_tokens']} / {out['same_tokens_prefix_kv_once']}")
        return
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    models = {attn: load(path, attn, dtype, args.autocast) for attn in {a for a, _ in VARIANTS.values()}}
    groups = getattr(models["sdpa"].model.layers[0].self_attn, "num_key_value_groups", 1)

    def run(variant, n):
        attn, buffered = variants_run[variant]
        kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, output_scores=True,
                  return_dict_in_generate=True)
        t = time.perf_counter()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == CAST_ONCE):
            out = generate_shared_prefix(models[attn], ids, mask, buffered_cache=buffered, **kw)
        return time.perf_counter() - t, out

    step_ms: dict[str, list[float]] = {name: [] for name in variants_run}
    last = {}
    for r in range(args.repeats):
        for name in variants_run:
            t1, _ = run(name, 1)
            tn, last[name] = run(name, args.new_tokens)
            step_ms[name].append(1000 * (tn - t1) / (args.new_tokens - 1))
        print(f"bench decode: round {r + 1}/{args.repeats}: "
              + ", ".join(f"{k} {v[-1]:.0f} ms" for k, v in step_ms.items()), file=sys.stderr, flush=True)
    med = {name: statistics.median(v) for name, v in step_ms.items()}
    ref = torch.stack(last["sdpa"].scores).float()
    variants = {}
    for name in variants_run:
        scores = torch.stack(last[name].scores).float()
        finite = torch.isfinite(ref) & torch.isfinite(scores)
        variants[name] = {"ms": round(med[name], 1), "speedup": round(med["sdpa"] / med[name], 2),
                          "same_tokens": bool(torch.equal(last["sdpa"].sequences, last[name].sequences)),
                          "max_score_diff": float((ref[finite] - scores[finite]).abs().max()),
                          "runs": [round(x, 1) for x in step_ms[name]]}
    best = variants[CAST_ONCE if args.autocast else "grouped_buffered"]
    out = {"rows": args.rows, "context": width, "same_prompt": args.same_prompt, "new_tokens": args.new_tokens,
           "dtype": "float32 weights, bf16 autocast" if args.autocast else args.dtype,
           "kv_groups": groups, **{f"{name}_ms": v["ms"] for name, v in variants.items()},
           "speedup": best["speedup"], "same_tokens": all(v["same_tokens"] for v in variants.values()),
           "max_score_diff": max(v["max_score_diff"] for v in variants.values()), "variants": variants}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"decode step, {args.rows} rows x {width} tokens, {args.dtype}: "
              + ", ".join(f"{k} {v['ms']} ms ({v['speedup']}x)" for k, v in variants.items())
              + f"; same tokens {out['same_tokens']}, max score diff {out['max_score_diff']:.2e}")
