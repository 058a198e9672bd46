"""Hugging Face ``generate`` that pays for a batch's common prompt prefix once.

A batch of step prompts repeats most of its tokens: every prompt starts with the same system text (rules
and tool schemas, ~700-1,000 tokens), and in a GRPO rollout's first round all G episodes of a task read the
same prompt. Left-padded ``generate`` prefills every row in full; on a 2-core CPU that prefill is most of a
round (8 rows of 1.3K tokens: 27 s fp32, measured with SmolLM2-135M). vLLM shares such prefixes itself
(prefix caching); this does the same for Hugging Face ``generate``, for any batch:

  1. P = the longest prefix common to all rows (their pads stripped), at most the shortest row less one
     token (``generate`` must process at least one new token per row).
  2. The prefix runs once, batch 1, through the backbone only (``model.get_decoder()``: no LM-head logits,
     so hooks on the head, such as seeded sampling's, see only ``generate``'s own calls); its key/value
     cache is repeated to B rows (``Cache.batch_repeat_interleave``).
  3. The rows are laid out prefix | padding | own suffix, padding in the middle with attention mask 0, so
     position ids (``generate`` derives them from the mask) and the cached keys line up, and ``generate``
     is called with that cache: it forwards only the B suffixes, then decodes as usual.

The key/value cache is a :class:`~atommem_rl.inference.buffered_cache.BufferedCache` (models whose layers all
use full attention): decode steps write into a buffer with room for ``max_new_tokens`` instead of
concatenating onto the whole cache every step; the plain call below gets one too.

The tokens are those of the ordinary left-padded call up to floating-point reassociation (batch-1 vs batch-B
kernels): ``tests/test_shared_prefix.py`` checks every step's scores agree within 1e-4 (tiny Llama and Qwen3
models; SmolLM2-135M measured in docs/BENCHMARKS.md). Below
``min_prefix`` shared tokens (or for one row) the plain call runs. Returned: what ``generate`` returns, of
the same width, so callers cut completions at ``width`` as before; the prompt part of each row is in the
shared layout (its padding in the middle), which callers that keep only the completion never see.
"""

from __future__ import annotations

import contextlib
from typing import Any

MIN_PREFIX = 16  # fewer shared tokens than this are not worth a second forward


def common_prefix_length(rows: list[list[int]]) -> int:
    """Length of the longest prefix shared by every row."""
    if not rows:
        return 0
    first, n = rows[0], min(len(r) for r in rows)
    for i in range(n):
        t = first[i]
        if any(r[i] != t for r in rows):
            return i
    return n


def strip_left_padding(input_ids, attention_mask) -> list[list[int]]:
    """The token rows of a left-padded batch, without their padding (mask 0 positions)."""
    return [[t for t, m in zip(ids, mask) if m] for ids, mask in zip(input_ids.tolist(), attention_mask.tolist())]


def shared_prefix_layout(rows: list[list[int]], prefix: int, pad_id: int):
    """(input_ids, attention_mask) lists: each row as prefix | pads | own suffix, all of one width."""
    width = max(len(r) for r in rows)
    ids, mask = [], []
    for r in rows:
        gap = width - len(r)
        ids.append(r[:prefix] + [pad_id] * gap + r[prefix:])
        mask.append([1] * prefix + [0] * gap + [1] * (len(r) - prefix))
    return ids, mask


def new_tokens_of(model, generate_kwargs: dict) -> int:
    """The ``max_new_tokens`` a ``generate`` call will use: its keyword, its ``generation_config``'s, the
    model's, else :data:`~atommem_rl.inference.buffered_cache.DEFAULT_RESERVE`."""
    from .buffered_cache import DEFAULT_RESERVE
    for source in (generate_kwargs, generate_kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        value = source.get("max_new_tokens") if isinstance(source, dict) else getattr(source, "max_new_tokens", None)
        if value:
            return int(value)
    return DEFAULT_RESERVE


def generate_shared_prefix(model, input_ids, attention_mask, *, pad_token_id: int | None = None,
                           min_prefix: int = MIN_PREFIX, stats: dict | None = None, generate=None,
                           buffered_cache: bool = True, **generate_kwargs: Any):
    """``model.generate(input_ids, attention_mask, **generate_kwargs)`` for a left-padded batch, with the
    batch's common prefix prefilled once (module docstring). ``generate``: the generate function to call
    (default ``model.generate``; :func:`shared_prefix_generation` passes the class's own, which it shadows).
    ``pad_token_id`` is passed on when given (the middle padding is masked, so its value does not matter).
    ``stats`` (optional) gets the counts: ``prompt_tokens`` (all rows, unpadded), ``shared_tokens`` (the
    prefix, counted once) and ``forwarded_prompt_tokens`` (what was actually prefilled)."""
    import torch

    generate = generate or model.generate
    if pad_token_id is not None:
        generate_kwargs["pad_token_id"] = pad_token_id
    if "past_key_values" in generate_kwargs:
        raise ValueError("generate_shared_prefix builds the key/value cache itself; do not pass past_key_values")
    rows = strip_left_padding(input_ids, attention_mask)
    total = sum(len(r) for r in rows)
    prefix = min(common_prefix_length(rows), min(len(r) for r in rows) - 1) if rows else 0
    cache = None
    if buffered_cache and generate_kwargs.get("use_cache", True):
        from .buffered_cache import cache_for  # transformers is imported only where generation runs

        cache = cache_for(model, new_tokens_of(model, generate_kwargs))
    if len(rows) < 2 or prefix < min_prefix:
        if stats is not None:
            stats.update(prompt_tokens=total, shared_tokens=0, forwarded_prompt_tokens=input_ids.numel())
        if cache is not None:
            generate_kwargs["past_key_values"] = cache
        return generate(input_ids=input_ids, attention_mask=attention_mask, **generate_kwargs)
    ids, mask = shared_prefix_layout(rows, prefix, 0 if pad_token_id is None else pad_token_id)
    device = input_ids.device
    ids = torch.tensor(ids, dtype=input_ids.dtype, device=device)
    mask = torch.tensor(mask, dtype=attention_mask.dtype, device=device)
    with torch.no_grad():
        out = model.get_decoder()(input_ids=ids[:1, :prefix], attention_mask=mask[:1, :prefix], use_cache=True,
                                  past_key_values=cache)
    cache = out.past_key_values
    cache.batch_repeat_interleave(len(rows))
    if stats is not None:
        stats.update(prompt_tokens=total, shared_tokens=prefix,
                     forwarded_prompt_tokens=prefix + len(rows) * (ids.size(1) - prefix))
    return generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **generate_kwargs)


@contextlib.contextmanager
def shared_prefix_generation(model, stats: list | None = None, decode=None):
    """Within this block ``model.generate`` (an instance attribute shadowing the class's method) is
    :func:`generate_shared_prefix`: a caller that owns the ``generate`` call, such as TRL's
    ``_generate_single_turn``, gets the shared prefill without being changed. ``stats`` (optional) gets
    one dict of counts per call. ``decode`` (optional): tried first with the same arguments, ``stats``
    included; its result is used unless it returns None
    (:func:`~atommem_rl.inference.compact_decode.generate_dropping_finished` for greedy calls)."""
    own = type(model).generate.__get__(model)

    def generate(input_ids=None, attention_mask=None, **kwargs):
        if input_ids is None or attention_mask is None:  # not a left-padded token batch: the plain call
            return own(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        counts: dict = {}
        result = None
        if decode is not None:
            result = decode(model, input_ids, attention_mask, stats=counts, **kwargs)
        if result is None:
            counts = {}
            result = generate_shared_prefix(model, input_ids, attention_mask, stats=counts, generate=own, **kwargs)
        if stats is not None:
            stats.append(counts)
        return result

    had = "generate" in vars(model)
    saved = vars(model).get("generate")
    model.generate = generate
    try:
        yield
    finally:
        if had:
            model.generate = saved
        else:
            del model.generate
