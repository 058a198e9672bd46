"""Rows that share a prompt prefix attend to one copy of its keys and values (cascade attention, the name
FlashInfer and vLLM give it): :class:`SharedPrefixKV`.

Why: a greedy batch of evaluation or rollout prompts starts with the same system prompt (the quickstart's:
695 of ~900 prompt tokens). :func:`~atommem_rl.inference.compact_decode.greedy_decode` prefilled that prefix
once and then repeated its cache to every row, so each decode step read the prefix's keys and values once
per row. On a CPU a decode step is bound by memory traffic: SmolLM2-135M in fp32 on 2 cores cost ~68 ms per
step plus ~5.7 ms per row with a ~1.1K-token cache, most of the per-row part that repeated prefix.

How: the prefix is prefilled once (batch 1) and its per-layer keys and values stay apart; the rows' own cache
holds only their own tokens (their positions still count the prefix). While a :class:`SharedPrefixKV` is
active (a context variable, so nothing else in the process sees it), ``sdpa_grouped`` attention
(:mod:`~atommem_rl.inference.grouped_attention`) calls :meth:`SharedPrefixKV.attend`, which computes

  * every row's queries against the prefix in one call, the rows folded into the query axis (no mask: every
    own token comes after the whole prefix), and
  * each row's queries against its own keys with the model's mask (padding and causal), the query heads of
    a key/value head folded together as ``sdpa_grouped`` does,

each with its log-sum-exp (torch's CPU flash-attention kernel returns it), then merges them exactly:
``o = (o_prefix * e^lse_prefix + o_own * e^lse_own) / (e^lse_prefix + e^lse_own)``. The sums are the same as
one softmax over prefix and own keys, up to floating-point reassociation.
``tests/test_cascade_attention.py`` checks it against ``sdpa``; ``atommem bench decode --finished`` times it.
"""

from __future__ import annotations

import contextlib
import contextvars

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("atommem_shared_prefix_kv", default=None)


def active_prefix():
    """The :class:`SharedPrefixKV` active in this context, or None."""
    return _ACTIVE.get()


def _flash(query, key, value, mask, scaling):
    """(output, log-sum-exp) of attention, torch's CPU flash kernel (the one public ``sdpa`` runs on CPU)."""
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, False,
                                                                       attn_mask=mask, scale=scaling)


class SharedPrefixKV:
    """The keys and values of a prompt prefix every row of a batch shares, one tensor pair per layer, each
    ``(1, key_value_heads, prefix_length, head_dim)``. Build it with :meth:`from_cache` from the cache of the
    prefix's prefill, and decode the rows inside :meth:`active`."""

    def __init__(self, keys: list, values: list):
        if len(keys) != len(values) or not keys:
            raise ValueError("SharedPrefixKV: one key and one value tensor per layer")
        if any(k.dim() != 4 or k.size(0) != 1 for k in keys):
            raise ValueError("SharedPrefixKV: prefix keys must be (1, heads, length, head_dim)")
        self.keys, self.values = list(keys), list(values)

    @classmethod
    def from_cache(cls, cache) -> "SharedPrefixKV":
        """From a transformers ``Cache`` whose every layer holds the prefix (batch 1)."""
        return cls([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers])

    @property
    def length(self) -> int:
        return self.keys[0].size(2)

    @contextlib.contextmanager
    def active(self):
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def attend(self, module, query, key, value, attention_mask, *, scaling=None, dropout: float = 0.0, **kwargs):
        """A transformers attention call (``query`` (B, H, L, D); ``key``/``value`` the rows' own cache
        (B, Hkv, S, D); ``attention_mask`` the model's 4D mask over the own keys, or None) answered over the
        prefix and the own keys. Returns ``(output (B, L, H, D), None)`` as every attention function does.
        A call it cannot answer exactly raises: ignoring the prefix would silently change the model."""
        import torch

        layer = getattr(module, "layer_idx", None)
        if torch.is_grad_enabled() or dropout or kwargs.get("position_bias") is not None \
                or getattr(module, "sliding_window", None) or layer is None or not 0 <= layer < len(self.keys):
            raise RuntimeError("a shared prefix is active but this attention call cannot use it (gradients, "
                               "dropout, a position bias, a sliding window or an unknown layer)")
        b, h, length, d = query.shape
        hkv, s = key.size(1), key.size(2)
        groups = h // hkv
        # one dtype for the kernel, which autocast does not reach (sdpa is on its list): under bf16 autocast the
        # rotary embedding leaves queries and keys in fp32 and the values in bf16; sdpa would run all in bf16
        kind = query.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else query.dtype
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        if self.keys[layer].dtype != dtype:  # once per layer, not on every decode step: the prefix does not change
            self.keys[layer], self.values[layer] = self.keys[layer].to(dtype), self.values[layer].to(dtype)
        pk, pv = self.keys[layer], self.values[layer]
        q = query.reshape(b, hkv, groups * length, d)  # heads are key/value-major: h = k * groups + g
        # the prefix: every row's queries in one call, rows folded into the query axis, no mask
        qp = q.transpose(0, 1).reshape(1, hkv, b * groups * length, d)
        out_p, lse_p = _flash(qp, pk, pv, None, scaling)
        out_p = out_p.reshape(hkv, b, groups * length, d).transpose(0, 1)
        lse_p = lse_p.reshape(hkv, b, groups * length).transpose(0, 1)
        # the rows' own keys under the model's mask (bool: True attends; or additive), else causal over the
        # last `length` keys; the G query heads of a key/value head folded as sdpa_grouped does
        def fold(m):
            return m.expand(b, 1, length, s).unsqueeze(2).expand(b, 1, groups, length, s).reshape(b, 1, groups * length, s)

        if attention_mask is not None and attention_mask.dtype != torch.bool:
            allowed, additive = fold(attention_mask > float("-inf")), fold(attention_mask).to(query.dtype)
        else:
            allowed = attention_mask if attention_mask is not None else None if length == 1 else \
                torch.ones(length, s, dtype=torch.bool, device=query.device).tril(s - length)
            allowed = None if allowed is None else fold(allowed)
            additive = None if allowed is None else \
                torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill(~allowed, float("-inf"))
        out_o, lse_o = _flash(q, key, value, additive, scaling)
        if allowed is not None:  # a query with no own key to attend to (left padding): the kernel says lse 0
            blind = ~allowed.any(-1).expand_as(lse_o)
            lse_o, out_o = lse_o.masked_fill(blind, float("-inf")), out_o.masked_fill(blind.unsqueeze(-1), 0.0)
        top = torch.maximum(lse_p, lse_o)
        wp, wo = (lse_p - top).exp().unsqueeze(-1), (lse_o - top).exp().unsqueeze(-1)
        out = (out_p.float() * wp + out_o.float() * wo) / (wp + wo)
        return out.to(query.dtype).reshape(b, h, length, d).transpose(1, 2).contiguous(), None
