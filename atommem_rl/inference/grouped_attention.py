"""Grouped-query attention without copying keys and values: ``attn_implementation="sdpa_grouped"``.

Hugging Face's ``sdpa`` attention repeats every key/value head ``num_key_value_groups`` times before
calling ``torch.nn.functional.scaled_dot_product_attention`` whenever a mask is given (``repeat_kv``): SDPA's
own ``enable_gqa`` is used only without a mask. A batch of left-padded prompts always has a mask, so every
decode step copies the whole key/value cache ``num_key_value_groups`` times (SmolLM2-135M: 3x; Qwen3-8B:
4x). On a CPU decode is bound by memory traffic, and that copy is most of it.

Here the query heads that share a key/value head are folded into the query-length axis instead:

    query (B, Hkv * G, L, D) -> (B, Hkv, G * L, D)    # heads h = k * G + g share key/value head k
    mask  (B, 1, L, S)       -> (B, 1, G * L, S)      # the same row of the mask for each of the G heads

and one SDPA call attends each folded row to its own key/value head: the same sums, no copy of the cache
(the mask is repeated G times, which for decoding, L = 1, is a broadcast). The output is unfolded back to
(B, L, H, D), what every Hugging Face attention function returns.

Without a mask (rows without padding: a GRPO group's first round) a decode step (L = 1) folds too: SDPA's
own ``enable_gqa``, which ``sdpa`` uses there, took half of such a rollout's time on this CPU (py-spy).
Where folding does not apply the function is ``sdpa`` itself: no grouping (G = 1), a prefill without a mask
(``is_causal``, which would be wrong once folded; compute-bound, so the copy matters less), a mask
with its own per-head values, dropout, position biases or a paged cache, and any call with gradients on
(training forwards: their speed folded was not measured, so they stay exactly what they were).
``tests/test_grouped_attention.py`` checks the logits and generated tokens against ``sdpa`` on tiny Llama
and Qwen3 models with padding; ``atommem bench decode`` measures the decode step.
"""

from __future__ import annotations

from .cascade_attention import active_prefix

NAME = "sdpa_grouped"


def sdpa_grouped_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                                   scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    prefix = active_prefix()
    if prefix is not None:  # rows decoding after a shared prefix kept once (greedy_decode)
        return prefix.attend(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    if attention_mask is None:  # decoding one token attends to every key: folding needs no mask
        mask_ok = query.size(2) == 1
    else:
        mask_ok = attention_mask.dim() == 4 and attention_mask.size(1) == 1
    foldable = (groups > 1 and not torch.is_grad_enabled() and mask_ok and dropout == 0.0
                and kwargs.get("position_bias") is None and kwargs.get("cache") is None
                and not kwargs.get("output_attentions", False))
    if not foldable:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    b, h, length, d = query.shape
    hkv = key.size(1)
    q = query.reshape(b, hkv, groups * length, d)  # heads are key/value-major: h = k * groups + g
    mask = attention_mask
    if mask is not None and length > 1:  # each of the G folded copies of a query position keeps that position's mask row
        mask = mask.unsqueeze(2).expand(b, 1, groups, length, mask.size(-1)).reshape(b, 1, groups * length, -1)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, h, length, d).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register ``sdpa_grouped`` with transformers (idempotent) and return its name, for
    ``from_pretrained(..., attn_implementation=...)`` or ``model.set_attn_implementation(...)``."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, sdpa_grouped_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks sdpa itself gets
    return NAME


def use_grouped_attention(model) -> bool:
    """Switch a model (or a PEFT model around one) whose attention is ``sdpa`` to ``sdpa_grouped`` for good
    (the same results; decoding without key/value copies). Other implementations (eager, flash, a packed
    training kernel already installed) are left alone. Returns whether it switched."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(inner, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    inner.set_attn_implementation(register())
    return True
