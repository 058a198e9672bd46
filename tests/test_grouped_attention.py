"""Grouped-query attention without key/value copies (atommem_rl/inference/grouped_attention.py).

``sdpa_grouped`` folds the query heads that share a key/value head into the query-length axis instead of
repeating the keys and values per head. Checked against transformers' own ``sdpa`` on random-weight tiny
Llama and Qwen3 models (4 query heads over 2 key/value heads) with left padding: the logits of a padded
prefill agree within 1e-5, and ``generate`` gives the same tokens with every step's scores within 1e-4 while
never calling ``repeat_kv`` (the copy it exists to avoid), which the plain ``sdpa`` does call. With
gradients on it is ``sdpa`` itself."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def path(request, tmp_path_factory):
    from atommem_rl.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp(request.param) / "m", arch=request.param, hidden_size=64, layers=2,
                      heads=4, kv_heads=2, intermediate_size=128)


def load(path, attn: str):
    from transformers import AutoModelForCausalLM

    from atommem_rl.inference.grouped_attention import register

    register()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).eval()


def padded_batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(10, 1000, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


@pytest.fixture
def repeat_kv_calls(monkeypatch):
    """How often transformers' sdpa attention copied keys/values per head."""
    import transformers.integrations.sdpa_attention as sdpa

    calls = []
    own = sdpa.repeat_kv

    def counted(hidden_states, n_rep):
        calls.append(n_rep)
        return own(hidden_states, n_rep)

    monkeypatch.setattr(sdpa, "repeat_kv", counted)
    return calls


def test_padded_prefill_logits_equal_sdpa(path):
    ids, mask = padded_batch([23, 9, 17])
    with torch.no_grad():
        want = load(path, "sdpa")(input_ids=ids, attention_mask=mask).logits
        got = load(path, "sdpa_grouped")(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()  # padded positions' logits are not defined by anything
    assert (got[keep] - want[keep]).abs().max().item() < 1e-5


def test_generate_same_tokens_without_copies(path, repeat_kv_calls):
    ids, mask = padded_batch([30, 12, 21, 5], seed=1)
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, output_scores=True,
              return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        plain = load(path, "sdpa").generate(input_ids=ids, attention_mask=mask, **kw)
        copies = len(repeat_kv_calls)
        grouped = load(path, "sdpa_grouped").generate(input_ids=ids, attention_mask=mask, **kw)
    assert copies > 0, "the reference sdpa path should copy keys/values (otherwise this test shows nothing)"
    assert len(repeat_kv_calls) == copies, "sdpa_grouped copied keys/values"
    assert torch.equal(plain.sequences, grouped.sequences)
    a, b = torch.stack(plain.scores), torch.stack(grouped.scores)
    finite = torch.isfinite(a)
    assert torch.equal(finite, torch.isfinite(b))
    assert (a[finite] - b[finite]).abs().max().item() < 1e-4


def test_decoding_without_padding_folds_too(path, monkeypatch):
    """Rows of one length have no mask: decode steps still fold (no fallback to sdpa's enable_gqa)."""
    import transformers.integrations.sdpa_attention as sdpa

    fallbacks = []
    own = sdpa.sdpa_attention_forward

    def counted(module, query, *args, **kwargs):
        fallbacks.append(query.size(2))
        return own(module, query, *args, **kwargs)

    ids = torch.randint(10, 1000, (3, 17), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, output_scores=True,
              return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        plain = load(path, "sdpa").generate(input_ids=ids, **kw)
        monkeypatch.setattr(sdpa, "sdpa_attention_forward", counted)
        grouped = load(path, "sdpa_grouped").generate(input_ids=ids, **kw)
    assert fallbacks and all(n > 1 for n in fallbacks), f"decode steps fell back to sdpa: {fallbacks}"
    assert torch.equal(plain.sequences, grouped.sequences)
    a, b = torch.stack(plain.scores), torch.stack(grouped.scores)
    finite = torch.isfinite(a)
    assert (a[finite] - b[finite]).abs().max().item() < 1e-4


def test_with_gradients_it_is_sdpa(path, repeat_kv_calls):
    ids, mask = padded_batch([11, 6], seed=2)
    want, got = load(path, "sdpa"), load(path, "sdpa_grouped")
    got.load_state_dict(want.state_dict())
    a = want(input_ids=ids, attention_mask=mask).logits
    n = len(repeat_kv_calls)
    b = got(input_ids=ids, attention_mask=mask).logits
    assert len(repeat_kv_calls) == 2 * n > 0  # the same sdpa path, copies included
    assert torch.equal(a, b)
    b.sum().backward()
    assert all(p.grad is not None for p in got.parameters() if p.requires_grad)


def test_use_grouped_attention_switches_only_sdpa(path):
    from atommem_rl.inference.grouped_attention import NAME, use_grouped_attention
    from atommem_rl.inference.hf_engine import HFEngine
    from atommem_rl.models import base_tokenizer

    model = load(path, "sdpa")
    assert use_grouped_attention(model) and model.config._attn_implementation == NAME
    assert not use_grouped_attention(model)  # idempotent
    eager = load(path, "eager")
    assert not use_grouped_attention(eager) and eager.config._attn_implementation == "eager"
    engine_model = load(path, "sdpa")
    HFEngine(engine_model, base_tokenizer())
    assert engine_model.config._attn_implementation == NAME


def bench_decode(capsys, *argv: str) -> dict:
    """``atommem bench decode --tiny ARGV --repeats 1 --json``, its printed object."""
    import argparse
    import json

    from atommem_rl.bench import decode

    parser = argparse.ArgumentParser()
    decode.add_arguments(parser)
    decode.main(parser.parse_args(["--tiny", *argv, "--repeats", "1", "--json"]))
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_bench_decode_tiny(capsys):
    out = bench_decode(capsys, "--rows", "4", "--context", "48", "--new-tokens", "3")
    assert out["kv_groups"] == 2 and out["rows"] == 4 and out["same_tokens"] is True
    assert out["max_score_diff"] < 1e-4 and set(out["variants"]) == {"sdpa", "grouped", "grouped_buffered"}
    assert all(isinstance(v["ms"], float) and v["same_tokens"] for v in out["variants"].values())  # tiny: ms is noise


def test_bench_decode_tiny_autocast(capsys):
    out = bench_decode(capsys, "--rows", "3", "--context", "40", "--new-tokens", "3", "--autocast")
    assert "grouped_buffered_cast_once" in out["variants"] and out["dtype"].endswith("bf16 autocast")


def test_bench_decode_finished_tiny(capsys):
    """--finished: rows ending after N/8..N tokens, generate against rows leaving the batch (compact_decode),
    with the shared prefix's cache per row and kept once (cascade_attention)."""
    out = bench_decode(capsys, "--rows", "4", "--context", "48", "--finished", "16")
    assert out["rows"] == 4 and out["same_tokens"] is True and out["kept_share"] == 0.562
    assert out["same_tokens_prefix_kv_once"] is True and out["prefix_kv_shared"] is True
    assert out["row_steps"]["drop_finished"] < out["row_steps"]["generate"] == 64 and out["drops"] >= 1
    with pytest.raises(SystemExit, match="autocast"):
        bench_decode(capsys, "--finished", "16", "--autocast")
