"""The buffered key/value cache (atommem_rl/inference/buffered_cache.py): decode steps write into a
preallocated buffer instead of concatenating onto the whole cache. ``generate`` with it gives the tokens and
scores of transformers' ``DynamicCache`` (tiny Llama and Qwen3, left padding, with and without a shared
prefix), and after the prompt no step makes a new buffer; methods that replace the layer's tensors
(``batch_repeat_interleave``, ``batch_select_indices``) or crop it keep the cache correct."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from atommem_rl.models import tiny_model

    path = tiny_model(tmp_path_factory.mktemp(request.param) / "m", arch=request.param, hidden_size=64, layers=2,
                      heads=4, kv_heads=2, intermediate_size=128)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def padded(rows):
    width = max(map(len, rows))
    return (torch.tensor([[0] * (width - len(r)) + r for r in rows]),
            torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows]))


def rows_of(lengths, shared=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(10, 1000, (shared,), generator=g).tolist()
    return [prefix + torch.randint(10, 1000, (n,), generator=g).tolist() for n in lengths]


def same_generation(a, b):
    assert torch.equal(a.sequences, b.sequences)
    x, y = torch.stack(a.scores), torch.stack(b.scores)
    finite = torch.isfinite(x)
    assert torch.equal(finite, torch.isfinite(y))
    assert (x[finite] - y[finite]).abs().max().item() < 1e-4


def test_layer_writes_in_place_and_survives_replacements():
    from atommem_rl.inference.buffered_cache import BufferedLayer

    layer, ref = BufferedLayer(reserve=4), []
    g = torch.Generator().manual_seed(0)

    def step(n, batch=2):
        k, v = torch.randn(batch, 2, n, 8, generator=g), torch.randn(batch, 2, n, 8, generator=g)
        ref.append((k, v))
        return layer.update(k, v)

    keys, _ = step(5)
    assert layer.reallocations == 1 and keys.shape == (2, 2, 5, 8)
    ptr = layer.key_buffer.data_ptr()
    for _ in range(4):  # the reserve: no new buffer, the same storage
        keys, values = step(1)
    assert layer.reallocations == 1 and layer.key_buffer.data_ptr() == ptr
    assert torch.equal(keys, torch.cat([k for k, _ in ref], dim=-2))
    assert torch.equal(values, torch.cat([v for _, v in ref], dim=-2))
    step(1)  # full: one new buffer with the old contents
    assert layer.reallocations == 2
    assert torch.equal(layer.keys, torch.cat([k for k, _ in ref], dim=-2))
    layer.crop(-3)  # a view of the same buffer: the next update overwrites the cropped tokens
    kept = torch.cat([k for k, _ in ref], dim=-2)[:, :, :-3]
    keys, _ = step(1)
    assert layer.reallocations == 2 and torch.equal(keys, torch.cat([kept, ref[-1][0]], dim=-2))
    layer.batch_repeat_interleave(2)  # DynamicLayer's own: new tensors, then a new buffer
    before = layer.keys.clone()
    keys, _ = step(1, batch=4)
    assert layer.reallocations == 3 and torch.equal(keys[:, :, :-1], before)
    before = layer.keys.clone()
    layer.batch_select_indices(torch.tensor([3, 0]))  # rows leaving a batch: gathered into a buffer with room
    assert torch.equal(layer.keys, before[[3, 0]]) and layer.key_buffer.size(-2) > layer.keys.size(-2)
    ptr = layer.key_buffer.data_ptr()
    keys, _ = step(1, batch=2)  # written in place: no second copy
    assert layer.reallocations == 3 and layer.key_buffer.data_ptr() == ptr
    assert torch.equal(keys[:, :, :-1], before[[3, 0]])


@pytest.mark.parametrize("shared", [0, 40], ids=["plain", "shared-prefix"])
def test_generate_equals_dynamic_cache(model, shared):
    from atommem_rl.inference.buffered_cache import BufferedCache
    from atommem_rl.inference.shared_prefix import generate_shared_prefix

    ids, mask = padded(rows_of([9, 3, 14, 6], shared=shared, seed=shared))
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, output_scores=True,
              return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        want = generate_shared_prefix(model, ids, mask, buffered_cache=False, **kw)
        got = generate_shared_prefix(model, ids, mask, **kw)
    same_generation(want, got)
    cache = got.past_key_values
    assert isinstance(cache, BufferedCache)
    # the prompt (or the prefix, then the repeated rows' suffixes) made the buffers; no decode step did
    per_layer = {layer.reallocations for layer in cache.layers}
    assert per_layer == ({1} if shared == 0 else {2})


def test_cache_for_only_full_attention(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3Config

    from atommem_rl.inference.buffered_cache import BufferedCache, cache_for

    config = Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=32, head_dim=16)
    assert isinstance(cache_for(AutoModelForCausalLM.from_config(config)), BufferedCache)
    config = Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=32, head_dim=16, use_sliding_window=True,
                         sliding_window=8, max_window_layers=1)
    assert cache_for(AutoModelForCausalLM.from_config(config)) is None
