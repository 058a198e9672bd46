"""Rows attending to one copy of a shared prefix's keys and values (atommem_rl/inference/cascade_attention.py):
the merged attention equals ``sdpa`` over the prefix repeated to every row plus the row's own keys, for
decode steps and prefills, with the model's mask as bool, additive or absent (causal), queries that see no own
key (left padding) included, in fp32 and bf16; calls it cannot answer exactly are refused; the prefix is
active only inside its context. Greedy decoding with it on tiny models: tests/test_compact_decode.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

B, H, HKV, P, S, D = 3, 4, 2, 6, 7, 8
PADS = [2, 0, 4]  # left padding of each row's own keys


def own_mask(length: int) -> torch.Tensor:
    """(B, 1, L, S) bool: causal (query i is key S - L + i) and no padding key."""
    keys = torch.arange(S)
    causal = keys[None, :] <= (S - length + torch.arange(length))[:, None]
    pad = torch.stack([keys >= p for p in PADS])
    return (causal[None] & pad[:, None, :])[:, None]


def reference(q, pk, pv, k, v, allowed):
    """sdpa over [prefix repeated per row | own keys], key/value heads repeated to the query heads."""
    keys = torch.cat([pk.expand(B, -1, -1, -1), k], 2).repeat_interleave(H // HKV, 1)
    values = torch.cat([pv.expand(B, -1, -1, -1), v], 2).repeat_interleave(H // HKV, 1)
    mask = torch.cat([torch.ones(B, 1, q.size(2), P, dtype=torch.bool), allowed], -1)
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask).transpose(1, 2)


def tensors(length: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, length, D), (1, HKV, P, D), (1, HKV, P, D), (B, HKV, S, D), (B, HKV, S, D)]
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


@pytest.mark.parametrize("length", [1, 5], ids=["decode", "prefill"])
@pytest.mark.parametrize("mask", ["bool", "additive", "none"])
def test_matches_sdpa_over_the_repeated_prefix(length, mask):
    from atommem_rl.inference.cascade_attention import SharedPrefixKV

    q, pk, pv, k, v = tensors(length)
    allowed = own_mask(length)
    if mask == "none":  # no padding: the model passes no mask, the own part is causal
        allowed = (torch.arange(S)[None, :] <= (S - length + torch.arange(length))[:, None]).expand(B, 1, length, S)
        given = None
    elif mask == "additive":
        given = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    else:
        given = allowed
    module = SimpleNamespace(layer_idx=1, num_key_value_groups=H // HKV)
    prefix = SharedPrefixKV([torch.zeros_like(pk), pk], [torch.zeros_like(pv), pv])  # layer 1's is used
    with torch.no_grad():
        out, weights = prefix.attend(module, q, k, v, given, scaling=D ** -0.5)
    assert weights is None and out.shape == (B, length, H, D)
    want = reference(q, pk, pv, k, v, allowed)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    if mask != "none" and length > 1:  # row 2's first queries see no own key: the prefix alone answers them
        assert not allowed[2, 0, 0].any()


def test_bf16_close_to_fp32():
    from atommem_rl.inference.cascade_attention import SharedPrefixKV

    q, pk, pv, k, v = tensors(5, torch.bfloat16, seed=1)
    module = SimpleNamespace(layer_idx=0, num_key_value_groups=H // HKV)
    with torch.no_grad():
        out, _ = SharedPrefixKV([pk], [pv]).attend(module, q, k, v, own_mask(5), scaling=D ** -0.5)
    assert out.dtype == torch.bfloat16
    want = reference(q.float(), pk.float(), pv.float(), k.float(), v.float(), own_mask(5))
    torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)


def test_refuses_what_it_cannot_answer():
    from atommem_rl.inference.cascade_attention import SharedPrefixKV

    q, pk, pv, k, v = tensors(1)
    prefix = SharedPrefixKV([pk], [pv])
    with pytest.raises(RuntimeError, match="cannot use it"):  # gradients: training forwards never share
        prefix.attend(SimpleNamespace(layer_idx=0), q, k, v, None)
    with torch.no_grad(), pytest.raises(RuntimeError, match="cannot use it"):
        prefix.attend(SimpleNamespace(layer_idx=3), q, k, v, None)
    with torch.no_grad(), pytest.raises(RuntimeError, match="cannot use it"):
        prefix.attend(SimpleNamespace(layer_idx=0, sliding_window=4), q, k, v, None)
    with pytest.raises(ValueError, match="one key and one value"):
        SharedPrefixKV([pk], [])
    with pytest.raises(ValueError, match=r"\(1, heads"):
        SharedPrefixKV([k], [v])


def test_active_only_inside_its_context():
    from atommem_rl.inference.cascade_attention import SharedPrefixKV, active_prefix

    _, pk, pv, _, _ = tensors(1)
    prefix = SharedPrefixKV([pk], [pv])
    assert active_prefix() is None
    with pytest.raises(KeyError):
        with prefix.active():
            assert active_prefix() is prefix and prefix.length == P
            raise KeyError("a failing decode")
    assert active_prefix() is None


def test_grouped_attention_answers_through_the_active_prefix():
    """sdpa_grouped (the evaluation engine's attention) hands a call to the active prefix."""
    from atommem_rl.inference.cascade_attention import SharedPrefixKV
    from atommem_rl.inference.grouped_attention import sdpa_grouped_attention_forward

    q, pk, pv, k, v = tensors(1, seed=2)
    module = SimpleNamespace(layer_idx=0, num_key_value_groups=H // HKV)
    allowed = own_mask(1)
    with torch.no_grad():
        alone, _ = sdpa_grouped_attention_forward(module, q, k, v, allowed, scaling=D ** -0.5)
        with SharedPrefixKV([pk], [pv]).active():
            merged, _ = sdpa_grouped_attention_forward(module, q, k, v, allowed, scaling=D ** -0.5)
    torch.testing.assert_close(merged, reference(q, pk, pv, k, v, allowed), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(alone, merged)


def test_under_bf16_autocast_mixed_dtypes_run_as_sdpa_would():
    """Under bf16 autocast the rotary embedding leaves queries and keys in fp32 and the values in bf16 (the
    GRPO rollouts' case): the call runs in bf16, as sdpa does under autocast, and stays close to fp32."""
    from atommem_rl.inference.cascade_attention import SharedPrefixKV

    q, pk, pv, k, v = tensors(1, seed=3)
    module = SimpleNamespace(layer_idx=0, num_key_value_groups=H // HKV)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = SharedPrefixKV([pk], [pv.bfloat16()]).attend(module, q, k, v.bfloat16(), own_mask(1), scaling=D ** -0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(q, pk, pv, k, v, own_mask(1)), atol=3e-2, rtol=3e-2)
