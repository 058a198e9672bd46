"""Tree attention over TRL's packed layout, for CPUs and GPUs without TRL's FlashAttention-3 kernel.

Layout (``trl.experimental.async_grpo.packing.TreeRow.pack``). A row of samples is folded into a prefix
trie and laid out in DFS pre-order; unary chains form *segments*. Segment ``s`` holds the packed
positions ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``, and its keys/values are the tokens of its root-to-segment
path, listed in ``tree_kv_index[cu_seqlens_k[s]:cu_seqlens_k[s+1]]`` (ancestors first, the segment itself
last). A token must see exactly its ancestors and itself: the whole path before its segment, and the
segment causally.

Algorithm. Per layer, the keys/values of every path are gathered once (``index_select``: its backward
is one ``index_add`` into the packed keys/values, so a shared prefix gets the gradient of every sample
that reads it); then each segment runs transformers' own SDPA attention (``sdpa_attention_forward``:
GQA, scaling, dropout as the model's sdpa path) over its gathered path, with an ``n x m`` boolean mask
``tril(m - n)`` (bottom-right causal: the ``m - n`` path tokens before the segment are all visible). A
root segment (``n == m``) needs no mask and takes SDPA's causal kernel. The work is that of the unique
query tokens against their own paths, the same score pairs TRL's varlen FlashAttention-3 call computes.

It is registered with transformers' ``AttentionInterface`` under ``TREE_SDPA`` with the keyword
arguments of TRL's ``tree_attention`` (``tree_kv_index``, ``tree_cu_seqlens_q``, ``tree_cu_seqlens_k``,
``tree_max_seqlen_q``, ``tree_max_seqlen_k``), and with a mask function that builds no 4D mask (the
layout is the mask), exactly as TRL registers its kernel. So the same model call runs with either:
:func:`tree_attention_name` picks TRL's kernel on CUDA when it loads, this one elsewhere.

The model keeps the tree attention between its forward and its backward: with gradient checkpointing a
layer's forward is run again during backward, and transformers looks the attention function up by name at
call time, so a model switched back to its own attention after the packed forward would recompute the
layers with the wrong attention (torch stops it: "a different number of tensors was saved"). Hence
:func:`use_tree_attention` switches the model once, for good, to a *dispatching* implementation: the tree
kernel for calls that carry the tree keyword arguments, the model's own implementation (and its mask) for
every other call (``generate``, TRL's padded rows), so those compute exactly what they did before.
"""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

TREE_SDPA = "tree_sdpa"

TREE_KWARGS = ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k", "tree_max_seqlen_q", "tree_max_seqlen_k")


@functools.lru_cache(maxsize=256)
def _path_mask(n: int, m: int, device: str) -> torch.Tensor:
    # query i of the segment sees the m - n path tokens before the segment and segment tokens 0..i
    return torch.ones(n, m, dtype=torch.bool, device=device).tril(m - n).view(1, 1, n, m)


def tree_sdpa_attention(module, query, key, value, attention_mask, *, tree_kv_index, tree_cu_seqlens_q,
                        tree_cu_seqlens_k, tree_max_seqlen_q=None, tree_max_seqlen_k=None, scaling=None,
                        dropout: float = 0.0, sliding_window=None, softcap=None, **kwargs):
    """transformers attention function: ``query`` (1, heads, N, D), ``key``/``value`` (1, kv_heads, N, D)
    over one packed row; returns (1, N, heads, D) as every transformers attention function does."""
    if sliding_window or softcap:
        raise NotImplementedError("tree_sdpa: sliding-window and soft-capped attention are not supported")
    if query.shape[0] != 1:
        raise ValueError(f"tree_sdpa takes one packed row (batch 1), got batch {query.shape[0]}")
    keys, values = key.index_select(2, tree_kv_index), value.index_select(2, tree_kv_index)
    q_bounds, k_bounds = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    device = str(query.device)
    outs = []
    for s in range(len(q_bounds) - 1):
        q0, q1, k0, k1 = q_bounds[s], q_bounds[s + 1], k_bounds[s], k_bounds[s + 1]
        n, m = q1 - q0, k1 - k0
        mask = None if n == m else _path_mask(n, m, device)
        out, _ = sdpa_attention_forward(module, query[:, :, q0:q1], keys[:, :, k0:k1], values[:, :, k0:k1], mask,
                                        dropout=dropout, scaling=scaling, is_causal=True)
        outs.append(out)
    return torch.cat(outs, dim=1), None


def register_tree_sdpa() -> str:
    """Register :func:`tree_sdpa_attention` (idempotent); returns its name."""
    AttentionInterface.register(TREE_SDPA, tree_sdpa_attention)
    AttentionMaskInterface.register(TREE_SDPA, lambda **kwargs: None)
    return TREE_SDPA


@functools.lru_cache(maxsize=4)
def _trl_kernel_loads(device_type: str) -> bool:
    if device_type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        from trl.experimental.async_grpo.packing import _flash_attn

        _flash_attn()  # downloads or loads the FA3 kernel; fails without the `kernels` package or the Hub
        return True
    except Exception:
        return False


def tree_attention_name(device: torch.device | str) -> str:
    """The attention implementation for packed rows on ``device``: TRL's FlashAttention-3 tree kernel on
    CUDA when it loads, else :data:`TREE_SDPA`; registered before it is returned."""
    if _trl_kernel_loads(torch.device(device).type):
        from trl.experimental.async_grpo.packing import TREE_ATTENTION, register_tree_attention

        register_tree_attention()
        return TREE_ATTENTION
    return register_tree_sdpa()


def _dispatching(tree_name: str, own: str) -> str:
    """Register (idempotent) and return the implementation that runs ``tree_name`` on packed calls and
    ``own`` (the model's implementation, with its mask function) on every other call."""
    name = f"{tree_name}_else_{own}"
    tree_fn, own_fn = ALL_ATTENTION_FUNCTIONS[tree_name], ALL_ATTENTION_FUNCTIONS[own]
    own_mask = ALL_MASK_ATTENTION_FUNCTIONS[own]

    def attention(module, query, key, value, attention_mask, **kwargs):
        if kwargs.get("tree_kv_index") is not None:
            return tree_fn(module, query, key, value, attention_mask, **kwargs)
        return own_fn(module, query, key, value, attention_mask, **kwargs)

    def mask(attention_mask=None, **kwargs):
        # a packed call has no 2D mask (its layout is the mask); any other call gets the model's own mask.
        # Not supported, and never made here: an unpacked call with position ids that restart and no mask.
        return None if attention_mask is None else own_mask(attention_mask=attention_mask, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)
    return name


def use_tree_attention(model, name: str) -> None:
    """Switch ``model`` (a transformers model, or a PEFT model around one) for good to a dispatching
    implementation: attention ``name`` for packed calls, the model's own for the rest (see the module
    docstring: it must hold through the backward). Idempotent."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    current = inner.config._attn_implementation
    if current.startswith(f"{name}_else_"):
        return
    own = current if current in ALL_ATTENTION_FUNCTIONS and current in ALL_MASK_ATTENTION_FUNCTIONS else "sdpa"
    inner.set_attn_implementation(_dispatching(name, own))
