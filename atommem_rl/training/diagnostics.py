"""TRL's generation diagnostics for the step-wise trainers, under TRL's own metric names.

``StepwiseGRPOTrainer`` replaces TRL's ``_generate_and_score_completions`` (episodes instead of single
completions), which is where TRL logs what shows a vLLM/trainer mismatch or completions cut at the length cap.
This module logs the same quantities over the generation batch's step samples, under the same names, so W&B
dashboards made for TRL work unchanged (mirrors TRL 1.16 ``GRPOTrainer._generate_and_score_completions``, the
blocks after "Log the metrics", "Log completion lengths" and "vllm_importance_sampling_correction"):

    num_tokens                                   prompt + completion tokens seen in training so far
    completions/{mean,min,max}_length            completion tokens per step sample
    completions/clipped_ratio                    share of step samples cut at max_completion_length (no EOS)
    completions/{mean,min,max}_terminated_length the same over samples that ended with EOS
    frac_reward_zero_std                         share of groups whose episode returns are all equal
    sampling/sampling_logp_difference/{mean,max} |log pi_old - log pi_vLLM| over trained tokens
    sampling/importance_sampling_ratio/{min,mean,max}

and, beyond TRL, ``sampling/masked_sequence_ratio``: the share of trained step samples whose importance weight
is 0 on every token (``*_mask`` modes drop them from the loss; with long completions and ``sequence_mask`` whole
episodes' steps can vanish this way, which nothing else shows).
"""

from __future__ import annotations

import torch
from accelerate.utils import gather_object

from envs.core import OPS


def _spread(m, name: str, values: list[float]) -> None:
    vals = values or [0.0]  # TRL logs zeros for an empty set
    m[f"completions/mean_{name}"].append(sum(vals) / len(vals))
    m[f"completions/min_{name}"].append(float(min(vals)))
    m[f"completions/max_{name}"].append(float(max(vals)))


def log_generation_diagnostics(trainer, mode: str, samples: list[tuple], output: dict, all_returns: torch.Tensor,
                               group: int) -> None:
    """Log the diagnostics above for this rank's real step samples ``samples`` (prompt ids, completion ids,
    ...; padding rows excluded), all ranks aggregated (every rank calls this once per generation batch)."""
    m = trainer._metrics[mode]
    ends = {*trainer.eos_token_ids, trainer._tokenizer.pad_token_id}
    local = [(len(s[0]), len(s[1]), bool(s[1]) and s[1][-1] not in ends) for s in samples]
    rows = gather_object(local)  # every rank's samples, concatenated
    if mode == "train":
        trainer.state.num_input_tokens_seen += sum(p + c for p, c, _ in rows)
    m["num_tokens"] = [trainer.state.num_input_tokens_seen]
    _spread(m, "length", [float(c) for _, c, _ in rows])
    m["completions/clipped_ratio"].append(sum(t for _, _, t in rows) / max(len(rows), 1))
    _spread(m, "terminated_length", [float(c) for _, c, t in rows if not t])
    grouped = all_returns.view(-1, group)
    m["frac_reward_zero_std"].append((grouped == grouped[:, :1]).all(dim=1).float().mean().item())

    ratio = output.get("importance_sampling_ratio")
    if ratio is None:
        return
    acc = trainer.accelerator
    mask = output["completion_mask"].bool()
    delta = (output["old_per_token_logps"] - output["sampling_per_token_logps"]).abs()
    delta = delta[mask & ~torch.isnan(delta)]  # NaN: tokens vLLM could not score (TRL excludes them too)
    zero = torch.zeros((), device=delta.device)
    m["sampling/sampling_logp_difference/mean"].append(
        acc.gather(delta.mean() if delta.numel() else zero).mean().item())
    m["sampling/sampling_logp_difference/max"].append(acc.gather(delta.max() if delta.numel() else zero).max().item())
    trained = mask.any(dim=1)
    per_seq = ratio.size(1) == 1  # sequence modes: one weight per sample
    flat = ratio[trained].flatten() if per_seq else ratio[mask]
    has = torch.tensor(float(flat.numel() > 0), device=delta.device)
    lo = flat.min() if flat.numel() else torch.tensor(float("inf"), device=delta.device)
    hi = flat.max() if flat.numel() else torch.tensor(float("-inf"), device=delta.device)
    total = flat.sum() if flat.numel() else zero
    stats = acc.gather(torch.stack([lo, hi, total, torch.tensor(float(flat.numel()), device=delta.device), has]).view(1, -1))
    stats = stats.view(-1, 5)
    if stats[:, 4].sum() > 0:
        m["sampling/importance_sampling_ratio/min"].append(stats[:, 0].min().item())
        m["sampling/importance_sampling_ratio/max"].append(stats[:, 1].max().item())
        m["sampling/importance_sampling_ratio/mean"].append((stats[:, 2].sum() / stats[:, 3].sum()).item())
    weights = ratio.expand_as(mask) if per_seq else ratio
    masked = (trained & ~((weights != 0) & mask).any(dim=1)).sum()
    counts = acc.gather(torch.stack([masked.float(), trained.sum().float()]).view(1, -1)).view(-1, 2).sum(dim=0)
    m["sampling/masked_sequence_ratio"].append((counts[0] / counts[1].clamp(min=1.0)).item())


def log_episodes(trainer, mode: str, recs: list[dict], all_returns: torch.Tensor, n_steps: int,
                 completion_tokens: int) -> None:
    """Reward, operation frequencies per step (AtomMem's training-dynamics figure), tool errors,
    episode lengths and tokens, averaged over all processes."""
    m = trainer._metrics[mode]
    m["reward"].append(all_returns.mean().item())
    m["reward_std"].append(all_returns.std().item() if all_returns.numel() > 1 else 0.0)
    local = {
        "em": sum(r.get("em", 0.0) for r in recs), "f1": sum(r.get("f1", 0.0) for r in recs),
        "episode_steps": sum(len(r["steps"]) for r in recs),
        "tool_errors": sum(r.get("tool_errors", 0) for r in recs),
        "crashes": sum(int(r.get("crashed", False)) for r in recs),
        "completion_tokens": float(completion_tokens),
        **{f"op_{op}": sum((r.get("ops") or {}).get(op, 0) for r in recs) for op in OPS},
        "episodes": len(recs), "steps": n_steps,
        # Hugging Face generate's prompt tokens and those it prefilled (shared_prefix_generation; 0, 0 on vLLM)
        # and, where rows that ended left the batch (compact_decode), rows decoded over decode steps and
        # tokens kept (0, 0 on generate's own path)
        **dict(zip(("prompt_tokens", "prefilled_tokens", "decoded_row_steps", "kept_tokens"),
                   map(float, getattr(trainer, "_prefill", (0, 0, 0, 0))))),
    }
    keys = sorted(local)
    totals = trainer.accelerator.gather(torch.tensor([float(local[k]) for k in keys], device=trainer.accelerator.device))
    totals = totals.view(-1, len(keys)).sum(0).tolist()
    agg = dict(zip(keys, totals))
    eps, steps = max(agg["episodes"], 1.0), max(agg["steps"], 1.0)
    m["episode/em"].append(agg["em"] / eps)
    m["episode/f1"].append(agg["f1"] / eps)
    m["episode/steps"].append(agg["episode_steps"] / eps)
    m["episode/crashes"].append(agg["crashes"])
    m["tools/errors_per_step"].append(agg["tool_errors"] / steps)
    m["tokens/completion_per_step"].append(agg["completion_tokens"] / steps)
    for op in OPS:
        m[f"ops/{op}_per_step"].append(agg[f"op_{op}"] / steps)
    if agg["prompt_tokens"]:
        m["rollout/prefilled_per_prompt_token"].append(agg["prefilled_tokens"] / agg["prompt_tokens"])
    if agg["kept_tokens"]:  # 1.0: no row decoded past its end
        m["rollout/decoded_per_kept_token"].append(agg["decoded_row_steps"] / agg["kept_tokens"])
