"""Advantages and their step samples for the step-wise trainers, and vLLM's importance-sampling ratio.

Group-relative advantages of episode returns (Dr. GRPO by default), broadcast to every step of an episode
(or one per step, PPO's GAE), and the truncated/masked importance weights TRL applies to vLLM's rollouts.
"""

from __future__ import annotations

import torch

from .grpo_config import IS_MODES


def group_advantages(returns: torch.Tensor, group_size: int, scale: str = "none") -> torch.Tensor:
    """Group-relative advantages of episode returns laid out as consecutive groups of ``group_size``.

    none: R - mean_group (Dr. GRPO); group: divided by the group std (+1e-4); batch: by the batch std.
    """
    grouped = returns.view(-1, group_size)
    adv = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True).expand_as(grouped).reshape(-1) if group_size > 1 else torch.zeros_like(adv)
        adv = adv / (std + 1e-4)
    elif scale == "batch":
        adv = adv / (returns.std() + 1e-4)
    # A group whose returns are all equal carries no signal, but its float mean need not equal the
    # values (three returns of 1/3 leave |A| ~ 3e-8, ~3e-4 after the group std): exact zeros, so the
    # group is dropped, skipped and kept out of the token normaliser like any other uninformative one.
    flat = (grouped == grouped[:, :1]).all(dim=1, keepdim=True).expand_as(grouped).reshape(-1)
    return adv.masked_fill(flat, 0.0)


def step_samples(episodes: list[list[tuple]], advantages: list[float | list[float]]) -> list[tuple]:
    """(prompt, completion, logps, A) for every step. An episode's advantage is either one number,
    broadcast to all its steps (GRPO), or one number per step (PPO's GAE)."""
    out = []
    for steps, adv in zip(episodes, advantages, strict=True):
        per_step = adv if isinstance(adv, list) else [adv] * len(steps)
        if len(per_step) != len(steps):
            raise ValueError(f"{len(per_step)} advantages for an episode of {len(steps)} steps")
        out.extend((p, c, lp, a) for (p, c, lp), a in zip(steps, per_step))
    return out


def importance_sampling_ratio(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                              clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """vLLM's sampling distribution differs from the trained policy's (kernels, precision): the rollout
    tokens are reweighted by pi_old / pi_vllm, per token (shape B x T) or per sequence (B x 1, the
    product over its tokens). ``*_truncate`` clamps the ratio to [clip_min, clip_max]; ``*_mask``
    zeroes it outside that range (the sample then carries no loss). None bounds are open. NaN sampling
    log-probabilities (unavailable from vLLM) count as no correction. These are TRL's modes and defaults."""
    if mode not in IS_MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {', '.join(IS_MODES)}, got {mode!r}")
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    lo = -float("inf") if clip_min is None else clip_min
    hi = float("inf") if clip_max is None else clip_max
    if mode.endswith("truncate"):
        return ratio.clamp(min=lo, max=hi)
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
