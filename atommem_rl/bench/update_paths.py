"""The update paths ``atommem bench update`` times and compares (``bench/update.py``).

TRL's padded rows (:func:`baseline_update`, :func:`rows_score`) against the trainer's prefix-shared packed
micro-batches (:func:`packed_update`, :func:`packed_score`, ``training/packing.py``): forward and backward of
the clipped GRPO loss with token-mean (``dapo``) normalisation, or the no-gradient scoring pass. Each
returns per-sample completion log-probabilities; :func:`_grads` takes the gradient a path left and
:func:`adam_first_step_figures` says how far apart two gradients leave the weights after Adam's first step.
"""

from __future__ import annotations

import contextlib

def baseline_update(model, samples, pad_id: int, rows: int = 0, autocast=None, forwards: int = 0,
                    backward=None) -> tuple[list, float]:
    """Today's path: padded rows, TRL's fused head (``add_fused_lm_head`` already applied), dapo loss,
    backward. Returns (per-sample completion log-probabilities, loss).

    Sharded (``bench/update_sharded.py``): ``forwards`` pads the forwards to that many with empty rows (every
    rank runs as many as the busiest; each gathers parameters), and ``backward(loss, last)`` runs each
    backward (gradient sync on the last one only, as the Trainer's accumulation)."""
    import torch

    total = sum(len(s[1]) for s in samples if s[3] is not None)
    rows = rows or max(len(samples), 1)
    parts = [samples[i:i + rows] for i in range(0, len(samples), rows)]
    parts += [[]] * (forwards - len(parts))
    backward = backward or (lambda loss, last: loss.backward())
    logps, loss_sum = [], 0.0
    for n, part in enumerate(parts):
        if not part:  # an empty forward: one padding row, nothing trained (loss 0 with a real graph)
            with autocast or contextlib.nullcontext():
                lp = model(input_ids=torch.tensor([[pad_id, pad_id]]), labels=torch.tensor([[-100, pad_id]]),
                           fused_lm_head=True).log_probs
            backward(lp.sum() * 0.0, n == len(parts) - 1)
            continue
        input_ids, attention, labels, completion_mask = _row_batch(part, pad_id)
        keep = completion_mask.size(1)
        with autocast or contextlib.nullcontext():
            lp = model(input_ids=input_ids, attention_mask=attention, labels=labels, fused_lm_head=True).log_probs
        lp = lp[:, -keep:]
        adv = torch.tensor([s[3] or 0.0 for s in part])[:, None]
        ratio = torch.exp(lp - lp.detach())
        per_token = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.28) * adv)
        loss = (per_token * completion_mask).sum() / max(total, 1)
        backward(loss, n == len(parts) - 1)
        loss_sum += loss.item()
        logps += [row[: len(s[1])].tolist() for row, s in zip(lp.detach(), part, strict=True)]
    return logps, loss_sum


def packed_update(model, samples, groups, budget: int, pad_id: int, score: str = "trained", autocast=None,
                  attn: str | None = None, count: int = 0, backward=None) -> tuple[list, float, int]:
    """The packed path: plan, pack, one tree-attention forward per micro-batch, dapo loss, backward.
    Returns (per-sample completion log-probabilities, loss, forwarded tokens). Sharded: ``count`` pads the
    plan with empty micro-batches (``packing.pad_microbatches``), ``backward`` as in :func:`baseline_update`."""
    import torch

    from atommem_rl.training.packing import (grpo_loss, microbatch_inputs, packed_logprobs, pad_microbatches,
                                             per_sample_logprobs, plan_microbatches, token_weights, tree_samples)

    trees = tree_samples(samples, groups)
    weights = torch.tensor(token_weights(list(range(len(samples))),
                                         [int(t["completion_mask"].sum()) for t in trees], "token"))
    got: list[list[float]] = [[] for _ in samples]
    loss_sum, forwarded = 0.0, 0
    plan = plan_microbatches(trees, budget)
    plan = pad_microbatches(plan, max(count, len(plan)))
    backward = backward or (lambda loss, last: loss.backward())
    for n, row in enumerate(plan):
        inputs = microbatch_inputs(row, pad_id)
        forwarded += inputs["forwarded_tokens"] if row.samples else 0
        with autocast or contextlib.nullcontext():
            lp = packed_logprobs(model, inputs, score=score, attn_implementation=attn)
        loss = grpo_loss(lp.float(), inputs, weights, epsilon_low=0.2, epsilon_high=0.28)
        backward(loss, n == len(plan) - 1)
        loss_sum += loss.item()
        for i, v in enumerate(per_sample_logprobs(lp.detach().float(), inputs, len(samples))):
            got[i] += v
    return got, loss_sum, forwarded


def rows_score(model, samples, pad_id: int, rows: int = 0) -> list:
    """The no-gradient pass over padded rows (TRL's reference / old-policy log-probabilities, fp32)."""
    import torch

    with torch.no_grad():
        out = []
        for start in range(0, len(samples), rows or len(samples)):
            part = samples[start:start + (rows or len(samples))]
            out += _rows_logprobs(model, part, pad_id)
        return out


def _rows_logprobs(model, part, pad_id: int) -> list:
    input_ids, attention, labels, completion_mask = _row_batch(part, pad_id)
    keep = completion_mask.size(1)
    lp = model(input_ids=input_ids, attention_mask=attention, labels=labels, fused_lm_head=True).log_probs[:, -keep:]
    return [row[: len(s[1])].tolist() for row, s in zip(lp, part, strict=True)]


def _row_batch(part, pad_id: int):
    """TRL's layout of samples as rows: prompts padded left, completions right; labels only on completions.
    Returns (input_ids, attention_mask, labels, completion_mask)."""
    import torch
    from trl.trainer.utils import pad

    prompt = pad([torch.tensor(s[0]) for s in part], padding_value=pad_id, padding_side="left")
    prompt_mask = pad([torch.ones(len(s[0]), dtype=torch.long) for s in part], padding_value=0, padding_side="left")
    completion = pad([torch.tensor(s[1]) for s in part], padding_value=pad_id, padding_side="right")
    completion_mask = pad([torch.ones(len(s[1]), dtype=torch.long) for s in part], padding_value=0, padding_side="right")
    input_ids = torch.cat([prompt, completion], 1)
    attention = torch.cat([prompt_mask, completion_mask], 1)
    labels = input_ids.masked_fill(attention == 0, -100)
    labels[:, :-completion.size(1)] = -100
    return input_ids, attention, labels, completion_mask


def packed_score(model, samples, groups, budget: int, pad_id: int, autocast=None, attn: str | None = None) -> list:
    """The no-gradient pass packed, as the trainer's ``_packed_scores``: trained positions only."""
    import torch

    from atommem_rl.training.packing import microbatch_inputs, packed_logprobs, per_sample_logprobs, plan_microbatches, tree_samples

    got: list[list[float]] = [[] for _ in samples]
    with torch.no_grad(), autocast or contextlib.nullcontext():
        for row in plan_microbatches(tree_samples(samples, groups), budget):
            inputs = microbatch_inputs(row, pad_id)
            lp = packed_logprobs(model, inputs, attn_implementation=attn)
            for i, v in enumerate(per_sample_logprobs(lp.float(), inputs, len(samples))):
                got[i] += v
    return got


def adam_first_step_figures(weights, g_a, g_b, lr: float, eps: float = 1e-8, prefix: str = "adam") -> dict:
    """How far apart two gradients of the same update leave the weights after Adam's first step, the step a
    GRPO run takes with them (torch's Adam/AdamW, no weight decay: bias-corrected m / sqrt(v) is g / |g|, so
    the update is -lr * g / (|g| + eps), about lr in each entry's sign whatever its size). ``weights`` is the
    flat fp32 weight vector in the gradients' order. Figures: the largest difference of the two updates as a
    share of lr, the share of entries whose updates differ by more than 1% of lr, and how many weights a bf16
    inference engine (vLLM here) would then serve differently: the generation side sees only those."""
    import torch

    u_a = (-lr * g_a / (g_a.abs() + eps)).float()
    u_b = (-lr * g_b / (g_b.abs() + eps)).float()
    diff = (u_a - u_b).abs()
    served = ((weights + u_a).bfloat16() != (weights + u_b).bfloat16())
    moved = ((weights + u_a).bfloat16() != weights.bfloat16())
    return {f"{prefix}_update_max_diff_lr": (diff.max() / lr).item() if lr else 0.0,
            f"{prefix}_update_differ_share": (diff > 0.01 * lr).double().mean().item(),
            f"{prefix}_served_bf16_differ": int(served.sum()),
            "served_bf16_moved": int(moved.sum()), "weights": weights.numel()}


def _grads(model):
    import torch

    # every trainable parameter, in order (a zero where none reached it): the order of the weight vector
    g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                   for p in model.parameters() if p.requires_grad])
    model.zero_grad(set_to_none=True)
    return g

