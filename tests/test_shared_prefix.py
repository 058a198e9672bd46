"""Shared-prefix generation (atommem_rl/inference/shared_prefix.py): a batch's common prompt prefix is
prefilled once and ``generate`` continues from its repeated cache. The scores of every generated step
equal the ordinary left-padded call's (within 1e-4, fp32), so the greedy tokens are the same; the
prefilled token count drops; batches without a long enough common prefix take the plain call; a caller
that owns the ``generate`` call (TRL's) gets it through ``shared_prefix_generation``, and the method is
restored afterwards. Random-weight tiny models (Llama and Qwen3 architectures) and the real SmolLM2
tokenizer."""

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


def left_padded(rows, pad=0):
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def batch(shared: int, suffixes: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(10, 1000, (shared,), generator=g).tolist()
    return [prefix + torch.randint(10, 1000, (n,), generator=g).tolist() for n in suffixes]


def test_prefix_length_and_layout():
    from atommem_rl.inference.shared_prefix import common_prefix_length, shared_prefix_layout, strip_left_padding

    assert common_prefix_length([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert common_prefix_length([[5], [6]]) == 0 and common_prefix_length([]) == 0
    rows = [[1, 2, 3, 4], [1, 2, 9]]
    ids, mask = shared_prefix_layout(rows, 2, pad_id=0)
    assert ids == [[1, 2, 3, 4], [1, 2, 0, 9]] and mask == [[1, 1, 1, 1], [1, 1, 0, 1]]
    assert strip_left_padding(*left_padded(rows)) == rows


@pytest.mark.parametrize("suffixes", [[7, 7, 7, 7], [3, 11, 6], [1, 1]], ids=["same-length", "ragged", "one-token"])
def test_scores_and_tokens_equal_the_plain_call(model, suffixes):
    from atommem_rl.inference.shared_prefix import generate_shared_prefix

    rows = batch(40, suffixes)
    ids, mask = left_padded(rows)
    kw = dict(max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        plain = model.generate(input_ids=ids, attention_mask=mask, **kw)
    stats: dict = {}
    shared = generate_shared_prefix(model, ids, mask, stats=stats, **kw)
    assert shared.sequences.shape == plain.sequences.shape
    width = ids.size(1)
    assert torch.equal(shared.sequences[:, width:], plain.sequences[:, width:])
    diff = max((a - b).abs().max().item() for a, b in zip(plain.scores, shared.scores))
    assert diff < 1e-4, diff
    assert stats["shared_tokens"] == 40 and stats["prompt_tokens"] == sum(map(len, rows))
    assert stats["forwarded_prompt_tokens"] == 40 + len(rows) * (width - 40) < ids.numel()


def test_identical_prompts_prefill_once_but_one_token(model):
    from atommem_rl.inference.shared_prefix import generate_shared_prefix

    rows = batch(30, [5]) * 4  # a GRPO group's first round: G copies of one prompt
    ids, mask = left_padded(rows)
    stats: dict = {}
    out = generate_shared_prefix(model, ids, mask, stats=stats, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert stats["shared_tokens"] == 34 and stats["forwarded_prompt_tokens"] == 34 + 4
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(out, plain)


def test_short_common_prefix_or_one_row_takes_the_plain_call(model):
    from atommem_rl.inference.shared_prefix import generate_shared_prefix

    for rows in (batch(3, [9, 12]), batch(40, [6])):  # 3 < MIN_PREFIX shared tokens; a single row
        ids, mask = left_padded(rows)
        stats: dict = {}
        out = generate_shared_prefix(model, ids, mask, stats=stats, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert stats["shared_tokens"] == 0 and stats["forwarded_prompt_tokens"] == ids.numel()
        assert torch.equal(out, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                                               pad_token_id=0))
    with pytest.raises(ValueError, match="past_key_values"):
        generate_shared_prefix(model, ids, mask, past_key_values=object(), max_new_tokens=1)


def test_context_manager_serves_a_caller_that_owns_generate_and_restores_it(model):
    from atommem_rl.inference.shared_prefix import shared_prefix_generation

    rows = batch(32, [4, 9, 2])
    ids, mask = left_padded(rows)
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    calls: list = []
    with shared_prefix_generation(model, calls):
        assert "generate" in vars(model)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert "generate" not in vars(model)  # the class's method again
    width = ids.size(1)  # the prompt part is in the shared layout (padding in the middle); completions match
    assert torch.equal(out[:, width:], plain[:, width:]) and calls[0]["shared_tokens"] == 32
