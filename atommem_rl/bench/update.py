"""``atommem bench update``: the GRPO policy update on real step samples, padded rows against packed rows.

Method. One training batch as the learning-signal run makes it: ``--episodes`` episodes (one GRPO group)
of one synthetic task (``--docs`` documents, one question, no confounders; the learning-signal
environment: chunks of ``--chunk-tokens``, update/delete/relations disabled, F1 reward) rolled out with
Hugging Face ``generate`` sampling at ``--temperature`` (at most ``--max-new-tokens`` per step) from the
policy (``--model``, default SmolLM2-135M-Instruct; ``--tiny``: a random-weight tiny Llama, for CI).
Every step becomes a sample (prompt ids, completion ids) with its episode's group-relative advantage
(Dr. GRPO); when all returns are equal (a tiny or untrained policy) the advantages are a fixed +-1
pattern instead (``advantages: "synthetic"``), since the update's cost does not depend on their values
and exactness needs them non-zero.

The update (forward + backward of the clipped GRPO loss, token-mean normalisation as TRL's
``loss_type="dapo"``, no optimizer step) is timed in one process, every variant in turn, ``--repeats``
rounds, medians reported:

* ``baseline``: today's path, TRL's: prompts padded left, completions right, ``--baseline-rows`` rows per
  forward (0: all, as the step-wise trainer's one micro-batch), TRL's fused LM head
  (``add_fused_lm_head``; off Triton devices it scores every position), fp32;
* ``packed_all``: prefix-shared packing (``training/packing.py``, ``--max-tokens`` unique tokens per
  micro-batch) with tree attention, every position scored, fp32 (the packing lever);
* ``packed``: the same, only trained positions scored, fp32 (the scoring lever);
* ``packed_bf16``: the same under bf16 autocast, where the CPU has native bf16 (the bf16 lever).

By default ``baseline``, ``packed`` and (with native bf16) ``packed_bf16`` run; ``--variants`` adds ``packed_all``.

``--scoring`` also times the no-gradient pass a step makes over the same samples when its loss needs the
reference (KL, ``beta`` > 0) or old-policy (vLLM importance-sampling correction) log-probabilities:
``score_rows`` (TRL's padded rows, ``--baseline-rows`` per forward, fp32) against ``score_packed``
(the trainer's packed pass, ``StepwiseGRPOTrainer._packed_scores``: the same packing, fp32) and
``score_packed_bf16``; their largest fp32 log-probability difference is ``score_max_logprob_diff``.

Exactness comes from an fp32 comparison of ``baseline`` and ``packed``: the largest difference of a
completion token's log-probability and the cosine of the two gradients. Printed (``--json``)::

    {"samples", "raw_tokens", "forwarded_tokens", "packing_ratio", "baseline_s", "packed_s", "speedup",
     "max_logprob_diff", "grad_cosine", "dtype", ...}

with ``packed_s`` the fastest packed variant's median, ``dtype`` its dtype, and every variant's median
and runs under ``variants``.

    atommem bench update --json                       # SmolLM2-135M, 2 episodes, 128 tokens, 3 rounds
    atommem bench update --episodes 8 --max-new-tokens 224 --repeats 5 --json   # the learning-signal batch
    atommem bench update --tiny --repeats 2 --json    # seconds: a random-weight tiny model
    atommem bench update --samples S.json --json      # roll out once into S.json; later runs only time
    atommem bench update --ranks 2 --json             # the sharded side: FSDP2 on 2 ranks (update_sharded.py)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from ..commands import at_most, nonneg_float, seed_int
from .update_paths import (_grads, adam_first_step_figures, baseline_update, packed_score,  # noqa: F401 (re-exported)
                           packed_update, rows_score)
from .update_samples import LEARNING_SIGNAL_ENV, ROLLOUT_FLAGS, cached_samples, rollout_samples  # noqa: F401


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="policy folder (default: SmolLM2-135M-Instruct base)")
    parser.add_argument("--tiny", action="store_true", help="a random-weight tiny Llama instead (CI)")
    # smaller defaults than the recorded runs' (--episodes 8 --max-new-tokens 224 or 128 --repeats 5: ~25 minutes
    # on a 2-core CPU), so that the defaults finish within 10 minutes there (4 episodes took past 11: TRL's
    # padded rows ~100 s a pass, 5 passes)
    parser.add_argument("--episodes", type=at_most(10**4), default=2, help="episodes of the one task, a GRPO group (default 2)")
    parser.add_argument("--docs", type=at_most(10**4), default=3, help="documents of the task (default 3)")
    parser.add_argument("--chunk-tokens", type=at_most(10**6), default=256)
    parser.add_argument("--max-new-tokens", type=at_most(10**5), default=128, help="tokens per step at most (default 128)")
    parser.add_argument("--temperature", type=nonneg_float, default=0.8, help="rollout sampling temperature (default 0.8)")
    parser.add_argument("--max-tokens", type=at_most(10**8), default=8192,
                        help="packed: unique tokens per micro-batch at most (max_tokens_per_microbatch; default 8192)")
    parser.add_argument("--baseline-rows", type=at_most(10**6, 0), default=0, help="baseline: rows per forward (default 0: all)")
    parser.add_argument("--repeats", type=at_most(1000), default=3, help="timed rounds of every variant (default 3)")
    parser.add_argument("--variants", default=None,
                        help="comma-separated from baseline,packed_all,packed,packed_bf16 (default: baseline,packed "
                             "and packed_bf16 where the CPU has native bf16; packed_all separates the packing lever)")
    parser.add_argument("--gradient-checkpointing", choices=("on", "off"), default="on",
                        help="recompute activations in backward, on both paths (default on, as the recipes: without it "
                             "8 padded rows of ~1.1K tokens of SmolLM2-135M exceed 24 GB)")
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--samples", default=None,
                        help="JSON file of the rolled-out step samples: read when it exists (and was made with the same "
                             "model and rollout flags), else written after the rollout, so a timing run that is "
                             "killed does not redo its rollout")
    parser.add_argument("--lr", type=nonneg_float, default=2e-5,
                        help="learning rate of the Adam first step compared after the update (default 2e-5, the "
                             "learning-signal recipe's)")
    parser.add_argument("--scoring", action="store_true",
                        help="also time the no-gradient scoring pass (reference / old-policy log-probabilities): "
                             "padded rows against packed, alternating with the update variants")
    parser.add_argument("--ranks", type=at_most(64), default=1,
                        help="2 or more: the sharded side, rows against packed under FSDP2 on that many gloo CPU "
                             "ranks (bench/update_sharded.py; default 1: one process)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


# --------------------------------------------------------------------------- main


def _variants(spec: str | None, bf16: bool) -> list[str]:
    known = ["baseline", "packed_all", "packed", "packed_bf16"]
    names = [v.strip() for v in spec.split(",") if v.strip()] if spec else ["baseline", "packed"] + (["packed_bf16"] if bf16 else [])
    bad = [v for v in names if v not in known]
    if bad or "baseline" not in names or len(names) < 2:
        raise ValueError(f"--variants takes baseline and at least one of packed_all,packed,packed_bf16, got {spec!r}")
    return names


def main(args) -> int:
    from atommem_rl.precision import cpu_bf16_supported

    if min(args.episodes, args.repeats, args.max_new_tokens, args.docs) < 1 or args.baseline_rows < 0:
        raise ValueError("--episodes, --repeats, --max-new-tokens and --docs must be at least 1")
    if args.max_tokens < 2:
        raise ValueError("--max-tokens must be at least 2")
    if args.ranks > 1 and (args.ranks > args.episodes or args.variants or args.scoring):
        raise ValueError("--ranks N times rows against packed (no --variants, no --scoring) and needs at least "
                         "N --episodes (each rank gets whole episodes)")
    bf16 = cpu_bf16_supported()
    variants = _variants(args.variants, bf16) if args.ranks == 1 else []
    if "packed_bf16" in variants and not bf16:
        raise ValueError("--variants packed_bf16: this CPU has no native bf16")
    with tempfile.TemporaryDirectory() as tmp:
        model, tok, path = _load(args, tmp)
        if args.ranks > 1:  # the ranks load the model themselves: from ``path``, alive while ``tmp`` is
            return _sharded(args, model, tok, path, tmp)
    return _single(args, model, tok, path, variants, bf16)


def _load(args, tmp: str):
    """(model in fp32, tokenizer, its path): ``--tiny`` builds a random-weight one in ``tmp``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from atommem_rl.models import check_checkpoint, tiny_model

    if args.tiny:
        path = str(tiny_model(os.path.join(tmp, "tiny"), hidden_size=32, layers=2, heads=2, kv_heads=1,
                              intermediate_size=64, seed=args.seed))
    else:
        from atommem_rl.policies.model_policy import default_model_path

        path = os.path.abspath(args.model) if args.model else default_model_path()
        check_checkpoint(path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.eval()  # dropout off (none in these models), so both paths compute the same function
    return model, tok, path


def _samples(args, model, tok, path: str):
    """(samples, episodes, advantage source, returns, rollout seconds): rolled out, or read from --samples."""
    roll = lambda: rollout_samples(model, tok, args)  # noqa: E731
    if args.samples:
        return cached_samples(args.samples, "tiny" if args.tiny else path, args, roll)
    t0 = time.perf_counter()
    samples, episodes, adv_source, returns = roll()
    return samples, episodes, adv_source, returns, time.perf_counter() - t0


def _sharded(args, model, tok, path: str, tmp: str) -> int:
    """The sharded side: samples here, then rows against packed on ``--ranks`` FSDP2 ranks."""
    from .update_sharded import run_sharded

    samples, episodes, adv_source, returns, rollout_s = _samples(args, model, tok, path)
    del model  # the ranks hold their own copies
    file = os.path.join(tmp, "samples.json")
    with open(file, "w") as f:
        json.dump({"samples": samples, "episodes": episodes}, f)
    out = run_sharded(args, path, file)
    out.update(model="tiny" if args.tiny else path, episodes=args.episodes, advantages=adv_source,
               returns=returns, rollout_s=round(rollout_s, 1), load_average=os.getloadavg())
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{args.ranks} FSDP2 ranks, samples per rank {out['samples_per_rank']}: rows {out['rows_s']} s, "
              f"packed {out['packed_s']} s: {out['speedup']}x; fp32 max log-prob diff {out['max_logprob_diff']:.2e}, "
              f"gradient cosine {out['grad_cosine']:.6f}")
    return 0


def _single(args, model, tok, path: str, variants: list[str], bf16: bool) -> int:
    import torch
    from trl.trainer.utils import add_fused_lm_head

    from atommem_rl.training.packing import step_group_ids
    from atommem_rl.training.tree_attention import tree_attention_name

    samples, episodes, adv_source, returns, rollout_s = _samples(args, model, tok, path)
    print(f"bench update: {len(samples)} step samples in {rollout_s:.0f} s, prompts up to "
          f"{max(len(s[0]) for s in samples)} tokens, {sum(len(s[0]) + len(s[1]) for s in samples)} raw tokens",
          file=sys.stderr, flush=True)
    groups = step_group_ids(episodes, args.episodes)
    add_fused_lm_head(model, outputs=("log_probs",))
    if args.gradient_checkpointing == "on":  # as the recipes; HF recomputes layers in backward only in train mode
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # these models have no dropout, so the function computed is the same
    attn = tree_attention_name("cpu")
    pad_id = tok.pad_token_id
    bf16_ctx = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731

    def run(variant: str):
        if variant == "score_rows":
            return rows_score(model, samples, pad_id, args.baseline_rows)
        if variant.startswith("score_packed"):
            return packed_score(model, samples, groups, args.max_tokens, pad_id, attn=attn,
                                autocast=bf16_ctx() if variant.endswith("bf16") else None)
        if variant == "baseline":
            return baseline_update(model, samples, pad_id, args.baseline_rows)
        score = "all" if variant == "packed_all" else "trained"
        return packed_update(model, samples, groups, args.max_tokens, pad_id, score=score, attn=attn,
                             autocast=bf16_ctx() if variant == "packed_bf16" else None)

    # exactness in fp32 (also the warm-up of both paths)
    print("bench update: exactness in fp32 (baseline, then packed)", file=sys.stderr, flush=True)
    base_lp, _ = run("baseline")
    g_base = _grads(model)
    packed_lp, _, forwarded = run("packed")
    g_packed = _grads(model)
    max_diff = max((abs(a - b) for x, y in zip(base_lp, packed_lp, strict=True) for a, b in zip(x, y, strict=True)),
                   default=0.0)
    # in float64: over 135M fp32 elements torch's fp32 cosine_similarity reported 1.031 for SmolLM2 (> 1)
    g_base, g_packed = g_base.double(), g_packed.double()
    cosine = (torch.dot(g_base, g_packed) / (g_base.norm() * g_packed.norm())).item()
    # the weights a first Adam step leaves, packed against rows: a bf16 generation engine serves them
    weights = torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])
    adam_fig = adam_first_step_figures(weights, g_base, g_packed, args.lr)

    # bf16 against fp32: how far the bf16 update's log-probabilities and gradient are from the fp32 baseline's
    # (not an exactness target: bf16 rounds; the figure says how much of the update's direction survives it)
    bf16_fig = {}
    if "packed_bf16" in variants:
        bf16_lp, _, _ = run("packed_bf16")
        g_bf16 = _grads(model).double()
        bf16_fig = {"bf16_max_logprob_diff": max((abs(a - b) for x, y in zip(base_lp, bf16_lp, strict=True)
                                                  for a, b in zip(x, y, strict=True)), default=0.0),
                    "bf16_grad_cosine": (torch.dot(g_base, g_bf16) / (g_base.norm() * g_bf16.norm())).item(),
                    "bf16_grad_norm_ratio": (g_bf16.norm() / g_base.norm()).item(),
                    # share of gradient elements whose sign differs: Adam's first steps move every weight by
                    # about lr in its gradient's sign, whatever the gradient's size
                    "bf16_sign_agreement": (torch.sign(g_bf16) == torch.sign(g_base)).double().mean().item()}
        # TRL's padded rows under the same autocast: is a gap bf16's own or the packed path's?
        baseline_update(model, samples, pad_id, args.baseline_rows, autocast=bf16_ctx())
        g_rows = _grads(model).double()
        bf16_fig["bf16_rows_grad_cosine"] = (torch.dot(g_base, g_rows) / (g_base.norm() * g_rows.norm())).item()
        bf16_fig["bf16_packed_vs_rows_grad_cosine"] = (torch.dot(g_bf16, g_rows) / (g_bf16.norm() * g_rows.norm())).item()
        adam_fig.update(adam_first_step_figures(weights, g_base, g_bf16, args.lr, prefix="adam_bf16"))
        adam_fig.update(adam_first_step_figures(weights, g_base, g_rows, args.lr, prefix="adam_rows_bf16"))
        del g_bf16, g_rows
    del weights

    scoring = []
    score_fig = {}
    if args.scoring:  # the no-gradient pass: exactness in fp32, then timed with the update variants
        scoring = ["score_rows", "score_packed"] + (["score_packed_bf16"] if bf16 else [])
        a, b = run("score_rows"), run("score_packed")
        score_fig["score_max_logprob_diff"] = max((abs(x - y) for r1, r2 in zip(a, b, strict=True)
                                                  for x, y in zip(r1, r2, strict=True)), default=0.0)
    times: dict[str, list[float]] = {v: [] for v in variants + scoring}
    for r in range(args.repeats):
        for v in variants + scoring:  # alternating: each round runs every variant once, in turn
            t = time.perf_counter()
            run(v)
            times[v].append(time.perf_counter() - t)
            model.zero_grad(set_to_none=True)
        print(f"bench update: round {r + 1}/{args.repeats}: "
              + ", ".join(f"{v} {times[v][-1]:.2f} s" for v in variants + scoring), file=sys.stderr, flush=True)
    med = {v: statistics.median(ts) for v, ts in times.items()}
    best = min((v for v in variants if v != "baseline"), key=med.get)
    if scoring:
        fastest = min(scoring[1:], key=med.get)
        score_fig.update({"score_rows_s": round(med["score_rows"], 3), "score_packed_s": round(med[fastest], 3),
                          "score_speedup": round(med["score_rows"] / med[fastest], 2), "score_variant": fastest})
    raw = sum(len(s[0]) + len(s[1]) for s in samples)
    width = max(len(s[0]) for s in samples) + max(len(s[1]) for s in samples)
    out = {
        "samples": len(samples), "raw_tokens": raw, "forwarded_tokens": forwarded,
        "packing_ratio": round(raw / forwarded, 3), "baseline_s": round(med["baseline"], 3),
        "packed_s": round(med[best], 3), "speedup": round(med["baseline"] / med[best], 2),
        "max_logprob_diff": max_diff, "grad_cosine": cosine, **bf16_fig, **adam_fig, **score_fig, "lr": args.lr,
        "dtype": "bfloat16" if best == "packed_bf16" else "float32",
        "packed_variant": best, "padded_tokens": width * len(samples) if not args.baseline_rows else None,
        "completion_tokens": sum(len(s[1]) for s in samples), "episodes": args.episodes,
        "episode_steps": [len(e) for e in episodes], "returns": returns, "advantages": adv_source,
        "max_tokens_per_microbatch": args.max_tokens, "attention": attn, "cpu_bf16": bf16,
        "model": "tiny" if args.tiny else path, "repeats": args.repeats, "rollout_s": round(rollout_s, 1),
        "gradient_checkpointing": args.gradient_checkpointing == "on", "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg(),
        "variants": {v: {"median_s": round(med[v], 3), "speedup": round(med["baseline"] / med[v], 2),
                         "runs_s": [round(t, 3) for t in times[v]]} for v in variants},
        **({"scoring": {v: {"median_s": round(med[v], 3), "runs_s": [round(t, 3) for t in times[v]]}
                        for v in scoring}} if scoring else {}),
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{len(samples)} step samples, {raw} raw tokens, {forwarded} forwarded (packing ratio "
              f"{out['packing_ratio']}); baseline {out['baseline_s']} s, packed ({best}) {out['packed_s']} s: "
              f"{out['speedup']}x; fp32 max log-prob diff {max_diff:.2e}, gradient cosine {cosine:.6f}")
        if bf16_fig:
            print(f"  bf16 against fp32: max log-prob diff {bf16_fig['bf16_max_logprob_diff']:.2e}, gradient cosine "
                  f"{bf16_fig['bf16_grad_cosine']:.6f} (TRL's rows in bf16: {bf16_fig['bf16_rows_grad_cosine']:.6f}), norm ratio {bf16_fig['bf16_grad_norm_ratio']:.4f}, "
                  f"same sign {bf16_fig['bf16_sign_agreement']:.4f}")
        print(f"  after one Adam step (lr {args.lr:g}): {adam_fig['served_bf16_moved']} of {adam_fig['weights']} "
              f"weights change in bf16; packed against rows in fp32: updates differ by at most "
              f"{adam_fig['adam_update_max_diff_lr']:.2e} lr, {adam_fig['adam_served_bf16_differ']} served bf16 weights differ"
              + (f"; bf16 packed against fp32 rows: {adam_fig['adam_bf16_served_bf16_differ']}, bf16 rows against "
                 f"fp32 rows: {adam_fig['adam_rows_bf16_served_bf16_differ']}" if bf16_fig else ""))
        for v in variants:
            print(f"  {v}: median {med[v]:.3f} s ({out['variants'][v]['speedup']}x)")
        if scoring:
            print(f"  no-gradient scoring pass: rows {score_fig['score_rows_s']} s, packed ({score_fig['score_variant']}) "
                  f"{score_fig['score_packed_s']} s: {score_fig['score_speedup']}x; fp32 max log-prob diff "
                  f"{score_fig['score_max_logprob_diff']:.2e}")
    return 0
