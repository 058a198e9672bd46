"""Greedy decoding that drops ended rows (atommem_rl/inference/compact_decode.py): each row's tokens are
those of greedy ``generate`` cut at the row's first stop token and its own limit, with and without a shared
prefix, whether rows leave the batch one at a time or all at the end, with the prefix's cache repeated per row
(``sdpa``) or kept once (``sdpa_grouped``: cascade_attention.py); the rows that ended really leave the
batch (fewer row-steps than ``generate`` computes); HFEngine gives the same completions either way; the
trainer's seeded call through shared_prefix_generation too; bad input is refused. (``atommem bench decode
--finished``: tests/test_grouped_attention.py.) Random-weight tiny models (Llama and Qwen3 architectures), fp32."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", params=["llama", "qwen3", "llama-grouped", "qwen3-grouped"])
def model(request, tmp_path_factory):
    """-grouped: ``sdpa_grouped`` attention, where the rows attend to one copy of a shared prefix's cache
    (cascade_attention.py); the references (``generate``) run on the same model."""
    from transformers import AutoModelForCausalLM

    from atommem_rl.inference.grouped_attention import register
    from atommem_rl.models import tiny_model

    arch, _, grouped = request.param.partition("-")
    path = tiny_model(tmp_path_factory.mktemp(request.param) / "m", arch=arch, hidden_size=64, layers=2,
                      heads=4, kv_heads=2, intermediate_size=128)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation=register() if grouped else "sdpa").eval()


def grouped(model) -> bool:
    return model.config._attn_implementation == "sdpa_grouped"


def rows_with(shared: int, suffixes: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(10, 1000, (shared,), generator=g).tolist()
    return [prefix + torch.randint(10, 1000, (n,), generator=g).tolist() for n in suffixes]


def plain_greedy(model, rows: list[list[int]], new: int) -> list[list[int]]:
    """Greedy ``generate`` without any stop token: every row runs ``new`` tokens."""
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[:, width:].tolist()


def cut(row: list[int], stops: set[int], limit: int) -> list[int]:
    row = row[:limit]
    return row[: next((i + 1 for i, t in enumerate(row) if t in stops), len(row))]


@pytest.mark.parametrize("shared", [40, 0], ids=["shared-prefix", "no-prefix"])
@pytest.mark.parametrize("drop_share", [0.0, 0.25, 1.01], ids=["each-row", "quarter", "never"])
def test_tokens_equal_greedy_generate_cut_at_stops(model, shared, drop_share):
    from atommem_rl.inference.compact_decode import greedy_decode

    rows = rows_with(shared, [5, 9, 3, 12, 7, 4], seed=1)
    ref = plain_greedy(model, rows, 16)
    # stop tokens taken from the reference so that rows end at different steps: row 0's 3rd token, row 2's 9th
    stops = {ref[0][2], ref[2][8]}
    limits = [16, 16, 16, 6, 16, 11]
    stats: dict = {}
    got = greedy_decode(model, rows, limits, stops, drop_share=drop_share, stats=stats)
    want = [cut(r, stops, m) for r, m in zip(ref, limits)]
    assert got == want
    assert len({len(w) for w in want}) > 2  # rows really ended at different steps
    assert stats["kept_tokens"] == sum(map(len, want))
    assert stats["shared_tokens"] == (shared if shared >= 16 else 0)
    assert stats["prefix_kv_shared"] == bool(shared and grouped(model))
    layers = model.config.num_hidden_layers  # a BufferedCache, written in place: buffers made per layer, not per step
    assert 0 < stats["cache_reallocations"] <= (2 if shared and not grouped(model) else 1) * layers
    full = len(rows) * max(map(len, want))  # what generate forwards: every row until the longest ends
    if drop_share <= 1:
        assert stats["drops"] >= 1 and stats["row_steps"] < full
    else:
        assert stats["drops"] == 0 and stats["row_steps"] == full


def test_hf_engine_same_completions_with_and_without_dropping(model):
    from atommem_rl.inference.hf_engine import HFEngine
    from atommem_rl.models import base_tokenizer

    tok = base_tokenizer()
    rows = rows_with(30, [4, 8, 2, 10], seed=2)
    ref = plain_greedy(model, rows, 12)
    model.generation_config.eos_token_id = ref[1][3]  # row 1 ends at its 4th token, the rest run on
    try:
        dropping = HFEngine(model, tok).generate(rows, [12, 12, 5, 12])
        plain = HFEngine(model, tok, drop_finished=False).generate(rows, [12, 12, 5, 12])
    finally:
        model.generation_config.eos_token_id = None
    assert [c.token_ids for c in dropping] == [c.token_ids for c in plain]
    assert [c.completion_tokens for c in dropping] == [len(c.token_ids) for c in plain]
    assert len(dropping[1].token_ids) <= 4 and len(dropping[2].token_ids) <= 5


def test_bad_input_is_refused(model):
    from atommem_rl.inference.compact_decode import greedy_decode

    assert greedy_decode(model, [], [], {1}) == []
    with pytest.raises(ValueError, match="limits"):
        greedy_decode(model, [[1, 2]], [3, 3], {1})
    with pytest.raises(ValueError, match="at least 1"):
        greedy_decode(model, [[1, 2]], [0], {1})
    with pytest.raises(ValueError, match="prompt token"):
        greedy_decode(model, [[1, 2], []], [3, 3], {1})


def test_trainer_generate_with_seeded_noise_drops_rows_and_keeps_each_rows_sample(model):
    """TRL's generate call under seeded sampling (greedy over per-row Gumbel noise, a hook on the LM head):
    through shared_prefix_generation with generate_dropping_finished, the completions cut at the first end
    token (what TRL keeps) equal generate's, and rows left the batch (the hook's seeds followed them)."""
    from transformers import GenerationConfig

    from atommem_rl.inference.compact_decode import generate_dropping_finished
    from atommem_rl.inference.shared_prefix import shared_prefix_generation
    from atommem_rl.training.seeded_sampling import GumbelNoise, warpers

    rows = rows_with(32, [3, 6, 2, 9, 5], seed=3)
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    seeds = [11, 12, 13, 14, 15]

    def run(eos, decode):
        # as TRL builds it (repetition_penalty 1.0, disable_compile), switched to greedy by seeded sampling
        config = GenerationConfig(max_new_tokens=14, do_sample=False, eos_token_id=eos, pad_token_id=0,
                                  repetition_penalty=1.0, disable_compile=True)
        hook = GumbelNoise(seeds, warpers(temperature=0.9))
        handle = model.get_output_embeddings().register_forward_hook(hook)
        stats: list = []
        try:
            with torch.no_grad(), shared_prefix_generation(model, stats, decode=decode):
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        finally:
            handle.remove()
        return out[:, width:].tolist(), stats, hook

    free, _, _ = run([], None)
    eos = [free[0][2], free[3][6]]
    want = [cut(r, set(eos), 14) for r in run(eos, None)[0]]
    got, stats, hook = run(eos, generate_dropping_finished)
    assert [cut(r, set(eos), 14) for r in got] == want
    assert len({len(w) for w in want}) > 1 and stats[0]["drops"] >= 1 and len(hook.row_seeds) < len(seeds)
    assert stats[0]["shared_tokens"] == 32 and stats[0]["forwarded_prompt_tokens"] < stats[0]["prompt_tokens"]
    assert stats[0]["prefix_kv_shared"] == grouped(model)
    # a call generate would run differently (a repetition penalty) is left to generate
    assert generate_dropping_finished(model, ids, mask, generation_config=GenerationConfig(
        max_new_tokens=4, do_sample=False, repetition_penalty=1.3)) is None
    assert generate_dropping_finished(model, ids, mask, generation_config=GenerationConfig(
        max_new_tokens=4, do_sample=True)) is None


def test_bf16_autocast_decodes_with_the_prefix_kept_once(model):
    """The GRPO rollouts and the bf16 evaluation decode under bf16 autocast: with the prefix's cache kept once
    (sdpa_grouped) the tokens are those of the per-row copy."""
    from atommem_rl.inference.compact_decode import greedy_decode

    rows = rows_with(24, [3, 7, 5], seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        once, stats = greedy_decode(model, rows, [8, 8, 8], set(), stats=(s := {})), s
        repeated = greedy_decode(model, rows, [8, 8, 8], set(), share_prefix_kv=False)
    assert stats["prefix_kv_shared"] == grouped(model)
    assert once == repeated
