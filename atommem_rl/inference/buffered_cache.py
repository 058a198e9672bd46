"""A key/value cache that decodes without copying itself: ``BufferedCache``.

transformers' ``DynamicCache`` grows each layer by ``torch.cat([old, new])`` on every decode step, which
allocates and copies the layer's whole cache once per generated token. On a CPU, where decoding is bound by
memory traffic, that copy reads and writes twice the bytes the attention itself reads (a 32-row batch of
SmolLM2-135M at 1.4K tokens: 2 GB of fp32 cache, copied every step).

``BufferedLayer`` keeps each layer's keys and values in a buffer with room for ``reserve`` more tokens:
``update`` writes the new tokens in place and hands the attention a view of the filled part, so a decode step
copies nothing. When the buffer is full, or when any other method of the layer has replaced its tensors
(``batch_repeat_interleave``, ``reorder_cache``, ``offload``: they are ``DynamicLayer``'s own, untouched),
the next ``update`` moves the current contents into a new buffer with ``reserve`` tokens to spare: one copy,
as one ``cat`` would have made. ``crop`` is a view of the same buffer and keeps it; ``batch_select_indices``
(rows leaving a batch) gathers the kept rows into a new buffer with the same room. Everything else is ``DynamicCache``'s, so ``generate`` and the models treat it as one.

Only for models whose layers all use full attention (sliding-window or chunked layers keep their own cache
types): :func:`cache_for` returns None for the others, and callers then let ``generate`` make its own
cache. ``tests/test_buffered_cache.py`` checks the tokens and scores of ``generate`` against
``DynamicCache`` and that no step reallocates; ``atommem bench decode`` measures it.
"""

from __future__ import annotations

import functools

from transformers.cache_utils import DynamicCache, DynamicLayer, get_layer_types_and_kwargs

DEFAULT_RESERVE = 256


class BufferedLayer(DynamicLayer):
    """``DynamicLayer`` whose ``update`` writes into a preallocated buffer (module docstring)."""

    def __init__(self, reserve: int = DEFAULT_RESERVE, **kwargs):
        super().__init__(**kwargs)
        self.reserve = max(1, int(reserve))
        self.key_buffer = self.value_buffer = None
        self.reallocations = 0  # buffers made so far (tests and benchmarks read it)

    def _holds(self, key_states, length: int) -> bool:
        """Whether the buffer still backs ``self.keys``/``self.values`` and has room for ``length`` tokens
        of rows shaped like ``key_states``."""
        kb, vb = self.key_buffer, self.value_buffer
        if kb is None or self.keys is None or self.keys.dim() != 4:
            return False
        return (self.keys.data_ptr() == kb.data_ptr() and self.values.data_ptr() == vb.data_ptr()
                and self.keys.stride() == kb.stride() and self.values.stride() == vb.stride()
                and kb.shape[:2] == key_states.shape[:2] and kb.size(-1) == key_states.size(-1)
                and length <= kb.size(-2) and kb.dtype == key_states.dtype and kb.device == key_states.device)

    def update(self, key_states, value_states, *args, **kwargs):
        import torch

        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = self.get_seq_length(), key_states.size(-2)
        if not self._holds(key_states, n + m):
            b, h, _, d = key_states.shape
            kb = torch.empty(b, h, n + m + self.reserve, d, dtype=key_states.dtype, device=key_states.device)
            vb = torch.empty(b, h, n + m + self.reserve, value_states.size(-1), dtype=value_states.dtype,
                             device=value_states.device)
            if n:
                kb[:, :, :n] = self.keys
                vb[:, :, :n] = self.values
            self.key_buffer, self.value_buffer = kb, vb
            self.reallocations += 1
        self.key_buffer[:, :, n:n + m] = key_states
        self.value_buffer[:, :, n:n + m] = value_states
        self.keys = self.key_buffer[:, :, :n + m]
        self.values = self.value_buffer[:, :, :n + m]
        return self.keys, self.values

    def batch_select_indices(self, indices) -> None:
        """Keep only the rows ``indices`` (a batch whose ended rows leave it): one gather into a new buffer
        with the same room, where ``DynamicLayer``'s indexing and the next ``update`` would copy twice."""
        n = self.get_seq_length()
        if n == 0 or self.key_buffer is None or self.keys.data_ptr() != self.key_buffer.data_ptr():
            return super().batch_select_indices(indices)
        self.key_buffer = self.key_buffer.index_select(0, indices)  # the spare room too: one copy, no second
        self.value_buffer = self.value_buffer.index_select(0, indices)
        self.keys = self.key_buffer[:, :, :n]
        self.values = self.value_buffer[:, :, :n]

    def reset(self) -> None:
        self.key_buffer = self.value_buffer = None
        super().reset()


class BufferedCache(DynamicCache):
    """``DynamicCache`` made of :class:`BufferedLayer` (lazily, one per layer as the model updates them).
    ``reserve``: free tokens a buffer is made with; the number of tokens ``generate`` will add is right."""

    def __init__(self, reserve: int = DEFAULT_RESERVE):
        super().__init__()
        self.layer_class_to_replicate = functools.partial(BufferedLayer, reserve=reserve)


def cache_for(model, reserve: int = DEFAULT_RESERVE) -> BufferedCache | None:
    """A new :class:`BufferedCache` for ``model``, or None where its layers are not all full attention."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    try:
        layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    except Exception:  # a config transformers cannot describe: leave the cache to generate
        return None
    if not layer_types or any(t != "full_attention" for t in layer_types):
        return None
    return BufferedCache(reserve=reserve)
