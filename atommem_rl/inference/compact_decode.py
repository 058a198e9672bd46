"""Greedy decoding that stops paying for a row once it has ended: :func:`greedy_decode`.

Hugging Face ``generate`` keeps every row of a batch until the last one stops, and until then computes the
finished rows too (their output is padding). In the quickstart's evaluation, 32 step prompts per call, the
trained checkpoints kept 47-63% of the tokens decoded that way: a reply of 100 tokens waits for the batch's
longest, up to the 224-token limit. On a CPU a decode step's cost grows with its rows (each reads its own
key/value cache), so the finished rows are most of the waste.

This decodes greedily with the model's own forward and, whenever at least ``drop_share`` of the batch's
rows have ended (a stop token or their own token limit), removes them from the batch: from the key/value
cache (``Cache.batch_select_indices``), the attention mask and the position ids. Removing rows copies the
rest of the cache once, so it waits until a share of the rows has ended instead of paying that copy for
every row that ends.

The prompt is prefilled as :func:`~atommem_rl.inference.shared_prefix.generate_shared_prefix` does: the
batch's common prefix once through the backbone, then the rows' own suffixes in the prefix | padding | suffix
layout, positions counted over the unmasked tokens (what ``generate`` derives from the mask). On models with
``sdpa_grouped`` attention the rows then attend to that one copy of the prefix's cache
(:mod:`~atommem_rl.inference.cascade_attention`); elsewhere it is repeated to every row. The key/value cache is a
:class:`~atommem_rl.inference.buffered_cache.BufferedCache` (transformers' ``DynamicCache`` for models with
other layer types).

Each row's tokens are those greedy ``generate`` picks, up to floating-point reassociation when the batch
shrinks (other batch sizes, other kernels): ``tests/test_compact_decode.py`` checks them against
``generate`` on tiny Llama and Qwen3 models; ``atommem bench decode --finished`` measures the time.
Sampling stays with ``generate`` (its logits processors and the trainer's seeded sampling hook into it).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

from .cascade_attention import SharedPrefixKV
from .grouped_attention import NAME as GROUPED
from .shared_prefix import MIN_PREFIX, common_prefix_length, shared_prefix_layout

DROP_SHARE = 0.25  # drop ended rows once they are this share of the batch (each drop copies the cache once)


def attends_grouped(model) -> bool:
    """Whether ``model`` (or the model inside a PEFT wrapper) runs ``sdpa_grouped`` attention on the calls
    greedy decoding makes: itself, or as the own implementation a packed-training dispatcher falls back to
    (``training/tree_attention.py``). Only there can the rows share one copy of the prefix's cache."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    return isinstance(name, str) and (name == GROUPED or name.endswith(f"_else_{GROUPED}"))


def greedy_decode(model, rows: list[list[int]], limits: list[int], stops, *, pad_token_id: int = 0,
                  min_prefix: int = MIN_PREFIX, drop_share: float = DROP_SHARE, on_drop=None,
                  stats: dict | None = None, share_prefix_kv: bool = True) -> list[list[int]]:
    """Greedy continuations of the token ``rows``: row i gets at most ``limits[i]`` tokens and ends with
    the first token in ``stops`` (kept). Returns one list of new token ids per row. ``on_drop`` (optional)
    is called with the batch rows kept (positions in the batch before the drop) each time rows leave.
    ``stats`` (optional) gets ``row_steps`` (rows forwarded summed over decode steps), ``kept_tokens``,
    ``drops``, ``prompt_tokens``, ``shared_tokens`` (the prefix prefilled once) and
    ``forwarded_prompt_tokens``, ``cache_reallocations`` (buffers a BufferedCache made: per layer one
    for the prefix and one for the rows, none per decode step) and ``prefix_kv_shared``.
    ``share_prefix_kv``: where the model attends with ``sdpa_grouped`` over full-attention layers, the rows
    attend to one copy of the prefix's keys and values (:mod:`~atommem_rl.inference.cascade_attention`)
    instead of a copy per row; False repeats it per row (the comparison ``atommem bench decode`` times)."""
    import torch
    from transformers import DynamicCache

    from .buffered_cache import BufferedCache, cache_for

    n = len(rows)
    if len(limits) != n:
        raise ValueError(f"greedy_decode: {n} rows but {len(limits)} limits")
    if any(len(r) == 0 for r in rows):
        raise ValueError("greedy_decode: every row needs at least one prompt token")
    if any(int(m) < 1 for m in limits):
        raise ValueError("greedy_decode: every row's token limit must be at least 1")
    out: list[list[int]] = [[] for _ in rows]
    if n == 0:
        return out
    stops = set(stops)
    device = next(model.parameters()).device
    cache = cache_for(model, max(limits))
    if cache is None:  # not `or`: an empty cache has no layers yet, so it is falsy
        cache = DynamicCache(config=model.config)
    prefix = min(common_prefix_length(rows), min(len(r) for r in rows) - 1) if n > 1 else 0
    prefix = prefix if prefix >= min_prefix else 0
    ids, mask = shared_prefix_layout(rows, prefix, pad_token_id)  # prefix 0: plain left padding
    ids = torch.tensor(ids, device=device)
    mask = torch.tensor(mask, device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # masked places get some position; no query reads them
    row_steps = drops = 0
    shared = None
    with contextlib.ExitStack() as scope, torch.no_grad():
        if prefix and share_prefix_kv and isinstance(cache, BufferedCache) and attends_grouped(model):
            # the prefix's keys and values once, apart; the rows' cache and mask cover their own tokens only
            kept = DynamicCache(config=model.config)
            model.get_decoder()(input_ids=ids[:1, :prefix], use_cache=True, past_key_values=kept)
            shared = scope.enter_context(SharedPrefixKV.from_cache(kept).active())
            mask = mask[:, prefix:]
        elif prefix:  # backbone only: no logits for a prefix nobody samples from
            model.get_decoder()(input_ids=ids[:1, :prefix], use_cache=True, past_key_values=cache)
            cache.batch_repeat_interleave(n)
        logits = model(input_ids=ids[:, prefix:], attention_mask=mask, position_ids=positions[:, prefix:],
                       past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        live = list(range(n))  # the original row of each batch row
        pos = positions[:, -1]
        while True:
            tokens = logits.argmax(-1)
            ended = []
            for b, (i, t) in enumerate(zip(live, tokens.tolist())):
                if len(out[i]) < limits[i] and (not out[i] or out[i][-1] not in stops):
                    out[i].append(t)
                if len(out[i]) >= limits[i] or out[i][-1] in stops:
                    ended.append(b)
            if len(ended) == len(live):
                break
            if len(ended) >= max(1, drop_share * len(live)):
                gone = set(ended)
                keep = torch.tensor([b for b in range(len(live)) if b not in gone], device=device)
                cache.batch_select_indices(keep)
                if on_drop is not None:
                    on_drop(keep.tolist())
                mask, pos, tokens = mask[keep], pos[keep], tokens[keep]
                live = [live[b] for b in keep.tolist()]
                drops += 1
            # rows that ended but wait for the next drop decode on; what they pick is ignored above
            mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
            pos = pos + 1
            row_steps += len(live)
            logits = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=pos[:, None],
                           past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    if stats is not None:
        stats.update(row_steps=row_steps + n, kept_tokens=sum(len(o) for o in out), drops=drops,
                     prompt_tokens=sum(len(r) for r in rows), shared_tokens=prefix,
                     forwarded_prompt_tokens=prefix + n * (ids.size(1) - prefix),
                     cache_reallocations=sum(getattr(layer, "reallocations", 0) for layer in cache.layers),
                     prefix_kv_shared=shared is not None)
    return out


# generation-config entries (``to_diff_dict``) under which ``generate`` is plain greedy search: the sampling
# knobs are inert with do_sample off; anything else (penalties, min lengths, beams, bad words, ...) has a
# logits processor or a search of its own, and the call goes to ``generate``
GREEDY_INERT = {"max_new_tokens", "max_length", "pad_token_id", "bos_token_id", "eos_token_id", "do_sample",
                "temperature", "top_p", "top_k", "min_p", "disable_compile", "transformers_version", "use_cache",
                "cache_implementation", "_from_model_config"}
NEUTRAL = {"repetition_penalty": 1.0, "num_beams": 1, "num_return_sequences": 1}  # entries that change nothing


_ROW_LIMITS: ContextVar[list[int] | None] = ContextVar("atommem_row_token_limits", default=None)


@contextlib.contextmanager
def row_token_limits(limits: list[int]):
    """Inside, :func:`generate_dropping_finished` ends row i after ``limits[i]`` tokens (or the call's
    ``max_new_tokens``, whichever is smaller), so a batch mixing answer-phase steps (a short environment limit)
    with reading steps stops paying for the short rows at their limit. A call with another number of rows
    ignores it (the caller cuts each row to its limit anyway: this only saves the decode steps)."""
    token = _ROW_LIMITS.set([int(m) for m in limits])
    try:
        yield
    finally:
        _ROW_LIMITS.reset(token)


def generate_dropping_finished(model, input_ids, attention_mask, stats: dict | None = None, **kwargs):
    """``model.generate(input_ids, attention_mask, **kwargs)`` through :func:`greedy_decode` when the call is
    plain greedy search (``generation_config``, or the model's, with nothing in it that ``generate`` would
    turn into a logits processor, and no other keyword); otherwise None, and the caller runs ``generate``.
    Returned like ``generate``: the left-padded prompts, then each row's new tokens, padded after its end.
    Rows get their own token limits inside :func:`row_token_limits`.

    A forward hook on the LM head sees the batch's rows: rows can leave only if every such hook has
    ``keep_rows(indices)`` (the trainer's seeded-sampling noise,
    :class:`~atommem_rl.training.seeded_sampling.GumbelNoise`); otherwise every row stays to the end."""
    import torch

    from .shared_prefix import strip_left_padding

    config = kwargs.pop("generation_config", None) or model.generation_config
    kwargs.pop("disable_compile", None)
    diff = config.to_diff_dict()
    other = [k for k, v in diff.items() if k not in GREEDY_INERT and NEUTRAL.get(k, object()) != v]
    if kwargs or other or config.do_sample or not config.max_new_tokens:
        return None
    if diff.get("cache_implementation") or diff.get("use_cache") is False:
        return None
    stops = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    stops = {t for t in stops if t is not None}
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    head = model.get_output_embeddings()
    hooks = list(head._forward_hooks.values()) if head is not None else []
    movable = all(hasattr(h, "keep_rows") for h in hooks)
    rows = strip_left_padding(input_ids, attention_mask)
    limits = [int(config.max_new_tokens)] * len(rows)
    own = _ROW_LIMITS.get()
    if own is not None and len(own) == len(rows):
        limits = [min(a, b) for a, b in zip(limits, own)]
    new = greedy_decode(model, rows, limits, stops, pad_token_id=pad,
                        drop_share=DROP_SHARE if movable else float("inf"),
                        on_drop=(lambda keep: [h.keep_rows(keep) for h in hooks]) if hooks else None, stats=stats)
    out = torch.full((len(rows), input_ids.size(1) + max(map(len, new))), pad, dtype=input_ids.dtype,
                     device=input_ids.device)
    out[:, :input_ids.size(1)] = input_ids
    for i, row in enumerate(new):
        out[i, input_ids.size(1):input_ids.size(1) + len(row)] = torch.tensor(row, dtype=input_ids.dtype)
    return out
