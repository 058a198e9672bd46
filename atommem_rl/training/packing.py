"""Prefix-shared packing of step samples for the policy update, and its per-token log-probabilities.

Why. Every step sample of a step-wise episode repeats the system prompt (rules, tool schemas), and the
G episodes of a task read the same chunk at step t, so forwarding samples one row each (padded to the
widest) pays for the same prefix many times. Here the samples of a micro-batch are folded into one
prefix trie with TRL's ``TreeRow`` (``trl.experimental.async_grpo.packing``), so a shared token is
forwarded (and back-propagated) once.

Algorithm.

1. :func:`tree_samples`: each step sample (prompt ids, completion ids, sampling log-probabilities,
   advantage) becomes TRL's sample dict (``input_ids`` = prompt + completion, ``completion_mask``,
   ``old_log_probs``, ``advantage``, ``group_id``) plus its ``index`` in the batch. The group is what a
   sample shares its prefix with: :func:`step_group_ids` gives (task, step), the G episodes of a task at
   step t (same system prompt, same chunk).
2. :func:`plan_microbatches`: a greedy planner over ``TreeRow``s under a token budget
   (``max_tokens_per_microbatch``) that bounds each micro-batch's *unique* tokens (and its trained ones,
   TRL's rule): samples are taken group by group; a sample goes to a row that already holds its group
   when it fits there, else to the first row it fits in, else to a new row. A sample longer than the
   budget gets a row of its own (never dropped: it is training data). :func:`pad_microbatches` appends
   empty micro-batches so that every rank runs the same number (their collectives stay paired).
3. :func:`microbatch_inputs`: ``TreeRow.pack`` lays the trie out (DFS pre-order, position ids = depth,
   per-segment key/value paths, ``shift_labels``, one loss term per trained token with ``token_index``);
   an empty micro-batch becomes a two-token phantom row with one loss term of weight 0, so it still runs
   a forward/backward through every parameter (DDP) and adds exactly zero.
4. :func:`packed_logprobs`: one forward of the backbone over the packed row with tree attention
   (``tree_attention``: TRL's FA3 kernel on CUDA when it loads, SDPA per segment elsewhere), then the LM
   head only at the positions whose next token is trained (TRL's ``ChunkedLogProbFunction`` on the
   compacted hidden states: TRL's own fused head scores every position off Triton devices), and the
   log-probability of each loss term gathered from its position. ``score="all"`` scores every position,
   TRL's behaviour on CPU, for comparison.
5. :func:`token_weights` and :func:`grpo_loss`: the clipped GRPO objective over the loss terms, each term
   weighted by its sample's weight: ``"token"`` 1 / (trained tokens of the whole batch, all ranks), TRL's
   ``loss_type="dapo"``; ``"episode"`` 1 / (episodes x trained tokens of its episode), so every episode
   weighs the same whatever its number of steps.

Wiring (``grpo.StepwiseGRPOTrainer``, ``max_tokens_per_microbatch`` > 0): ``_generate_and_score_completions``
keeps each row's (episode, group); ``_pack_generation_batch`` plans the trained rows with
:func:`plan_microbatches`, pads to the largest count of any rank (and rows per micro-batch to the largest,
since TRL's loss gathers per-row metrics) and deals the micro-batches to the micro-steps; TRL's own
``_compute_loss`` then runs per packed micro-batch, its per-token log-probabilities from
:func:`packed_logprobs` (through the DDP wrapper's forward when there is one). The step's no-gradient
passes (reference log-probabilities for the KL term, old-policy ones for the importance-sampling
correction) run packed as well (``_packed_scores``: the unwrapped model, no collective under DDP), laid out as
TRL's rows so its loss reads them unchanged.

Under FSDP2 (``fully_shard``, accelerate's FSDP2 preparation; on CPU ranks only through the rehearsal switch of
``fsdp_cpu.py``) the parameters are DTensor shards gathered inside their modules' forwards, so
:func:`packed_logprobs` scores through TRL's fused LM head inside the model's own forward
(:func:`_sharded_logprobs`: TRL gathers the head with ``full_tensor()``) instead of reading ``head.weight``;
every forward gathers, so the no-gradient passes are padded to the same count on every rank like the update;
the several backwards of a micro-step reduce once, through accelerate's ``no_sync`` (FSDP2's
``set_requires_gradient_sync``). :func:`sharding_refusal` names the modes that stay refused (DeepSpeed, FSDP1). :func:`grpo_loss` and
:func:`token_weights` are the by-hand references (bench, tests); the trainer's episode weighting scales
the advantages instead (``_episode_scale``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from trl.experimental.async_grpo.packing import TreeRow
from trl.kernels import ChunkedLogProbFunction

from atommem_rl.precision import autocast_dtype

from . import fsdp_cpu
from .tree_attention import TREE_KWARGS, tree_attention_name, use_tree_attention

# before any Accelerator is built (the trainers import this module): accelerate's FSDP2 on CPU ranks, for
# rehearsals only, when ATOMMEM_REHEARSE_FSDP_ON_CPU=1 (see fsdp_cpu.py); a no-op otherwise
fsdp_cpu.install()

# TRL's vocabulary tile for the chunked log-probabilities (trl.trainer.utils)
VOCAB_CHUNK = 32768


# --------------------------------------------------------------------------- samples and groups


def step_group_ids(episodes: Sequence[Sequence[Any]], group_size: int) -> list[tuple[int, int]]:
    """(task, step) of every step sample, in :func:`grpo.step_samples` order: episodes are laid out as
    consecutive groups of ``group_size`` copies of one task, and at step t they read the same chunk."""
    return [(e // group_size, t) for e, steps in enumerate(episodes) for t in range(len(steps))]


def tree_samples(samples: Sequence[tuple], group_ids: Sequence[Any]) -> list[dict[str, Any]]:
    """TRL ``TreeRow`` sample dicts from (prompt ids, completion ids, logps or None, advantage or None).

    An advantage of None (a padding copy, as the trainer makes) trains nothing: its completion mask is 0."""
    out = []
    for i, ((prompt, completion, logps, adv), group) in enumerate(zip(samples, group_ids, strict=True)):
        ids = list(prompt) + list(completion)
        trained = adv is not None and len(completion) > 0
        mask = [0] * len(prompt) + [int(trained)] * len(completion)
        old = [0.0] * len(prompt) + (list(logps) if logps else [0.0] * len(completion))
        out.append({"input_ids": torch.tensor(ids, dtype=torch.long), "completion_mask": torch.tensor(mask),
                    "old_log_probs": torch.tensor(old, dtype=torch.float32),
                    "advantage": float(adv or 0.0), "group_id": group, "index": i})
    return out


# --------------------------------------------------------------------------- planning


def plan_microbatches(samples: Sequence[dict[str, Any]], max_tokens_per_microbatch: int) -> list[TreeRow]:
    """Pack ``samples`` into ``TreeRow``s of at most ``max_tokens_per_microbatch`` unique tokens each."""
    if max_tokens_per_microbatch < 2:
        raise ValueError(f"max_tokens_per_microbatch must be at least 2, got {max_tokens_per_microbatch}")
    order: dict[Any, list[dict[str, Any]]] = {}
    for s in samples:  # group by group, groups in first-seen order: a group's prefix is built once
        order.setdefault(s["group_id"], []).append(s)
    rows: list[TreeRow] = []
    for group in order.values():
        for s in group:
            if len(s["input_ids"]) > max_tokens_per_microbatch:
                warnings.warn(f"a step sample of {len(s['input_ids'])} tokens exceeds max_tokens_per_microbatch="
                              f"{max_tokens_per_microbatch}: it gets a micro-batch of its own", stacklevel=2)
                rows.append(TreeRow())
                rows[-1].add(s)
                continue
            fitting = [r for r in rows if r.fits(s, max_tokens_per_microbatch)]
            home = [r for r in fitting if s["group_id"] in r.groups]
            row = (home or fitting or [None])[0]
            if row is None:
                row = TreeRow()
                rows.append(row)
            row.add(s)
    return rows


def unique_tokens(row: TreeRow) -> int:
    """Tokens the row forwards (its trie's nodes)."""
    return len(row.tokens)


def pad_microbatches(rows: list[TreeRow], count: int) -> list[TreeRow]:
    """``rows`` followed by empty micro-batches up to ``count`` (the largest count over the ranks), so every
    rank runs the same number of forwards/backwards."""
    if count < len(rows):
        raise ValueError(f"cannot pad {len(rows)} micro-batches to {count}")
    return list(rows) + [TreeRow() for _ in range(count - len(rows))]


# --------------------------------------------------------------------------- model inputs


def _phantom(pad_token_id: int) -> dict[str, Any]:
    return {"input_ids": torch.tensor([pad_token_id, pad_token_id]), "completion_mask": torch.tensor([0, 1]),
            "old_log_probs": torch.zeros(2), "advantage": 0.0, "group_id": None, "index": -1}


def microbatch_inputs(row: TreeRow, pad_token_id: int, device: torch.device | str = "cpu") -> dict[str, Any]:
    """``TreeRow.pack`` of the row as tensors on ``device``, plus ``sample_index`` (M: the batch index of
    each loss term's sample, -1 for the phantom term of an empty micro-batch) and ``forwarded_tokens``."""
    if not row.samples:
        row = TreeRow()
        row.add(_phantom(pad_token_id))
    packed = row.pack()
    index = torch.tensor([s["index"] for s in row.samples], dtype=torch.long)
    out: dict[str, Any] = {k: v.to(device) for k, v in packed.items()}
    out["sample_index"] = index[packed["segment_id"]].to(device)
    out["forwarded_tokens"] = int(packed["input_ids"].numel())
    return out


def term_positions(inputs: dict[str, Any], n_samples: int) -> torch.Tensor:
    """Each loss term's completion position within its sample (a sample's terms are consecutive, in completion
    order): with ``segment_id`` (the term's sample in the row) it places a term in TRL's rows x positions layout."""
    seg = inputs["segment_id"]
    starts = torch.cumsum(torch.bincount(seg, minlength=max(n_samples, 1)), 0)
    starts = torch.cat([starts.new_zeros(1), starts[:-1]])
    return torch.arange(seg.numel(), device=seg.device) - starts[seg]


def tree_kwargs(inputs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments tree attention reads (TRL's names), from :func:`microbatch_inputs`."""
    max_q, max_k = inputs["tree_max_seqlens"].tolist()
    kw = {k: inputs[k] for k in TREE_KWARGS[:3]}
    kw["tree_max_seqlen_q"], kw["tree_max_seqlen_k"] = int(max_q), int(max_k)
    return kw


# --------------------------------------------------------------------------- log-probabilities


def _causal_lm_parts(model):
    """(backbone, LM head, final logit soft-capping) of a causal LM, under a PEFT wrapper too."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    text_config = inner.config.get_text_config()
    return inner.base_model, inner.get_output_embeddings(), getattr(text_config, "final_logit_softcapping", None)


def sharding_refusal(distributed_type, *, fsdp2: bool) -> str | None:
    """Why the packed update cannot run under ``distributed_type`` (accelerate's), or None where it can: one
    process, DDP, FSDP2. Not DeepSpeed: accelerate's backward there steps the engine on every backward made
    on an accumulation boundary (the engine counts micro-steps itself), so the several backwards of a packed
    micro-step would each count as one, and DeepSpeed cannot run on a CPU machine to test another way. Not
    FSDP1 (flat parameters, untested): use FSDP2."""
    from accelerate.utils import DistributedType

    if distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        return None
    if distributed_type == DistributedType.FSDP and fsdp2:
        return None
    if distributed_type == DistributedType.DEEPSPEED:
        return ("max_tokens_per_microbatch is not supported under DeepSpeed (ZeRO-3 and ZeRO-2): launch with "
                "recipes/accelerate/fsdp2.yaml (FSDP2) for a packed update, or set max_tokens_per_microbatch: 0")
    if distributed_type == DistributedType.FSDP:
        return ("max_tokens_per_microbatch needs FSDP2 (fsdp_version: 2, recipes/accelerate/fsdp2.yaml), not FSDP1; "
                "or set max_tokens_per_microbatch: 0")
    return (f"max_tokens_per_microbatch runs on one process, DDP or FSDP2, not under {distributed_type.value}; "
            "set max_tokens_per_microbatch: 0")


def is_sharded(model) -> bool:
    """Whether ``model`` (or a module in it) is sharded by FSDP2's ``fully_shard``: its parameters are DTensor
    shards, gathered only inside its modules' forwards."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _sharded_logprobs(model, call: dict[str, Any], inputs: dict[str, Any], with_entropy: bool):
    """:func:`packed_logprobs` of an FSDP2-sharded model: TRL's fused LM head (``add_fused_lm_head``, which
    GRPOTrainer installs on the policy and the reference model) inside the model's own forward, so FSDP2's
    hooks gather every layer and its ``full_tensor()`` gathers the sharded head once; the backward reduces
    through FSDP2's post-backward hooks. It scores the positions whose label is not -100 on Triton devices
    and every position elsewhere (TRL's rule); the loss terms read their positions."""
    out = model(**call, shift_labels=inputs["shift_labels"][None], fused_lm_head=True)
    if getattr(out, "log_probs", None) is None:
        raise RuntimeError("a packed update of an FSDP-sharded model needs TRL's fused LM head on it "
                           "(trl.trainer.utils.add_fused_lm_head, installed by GRPOTrainer)")
    at = inputs["token_index"]
    logps = out.log_probs[0][at]
    if not with_entropy:
        return logps
    if out.entropy is None:
        raise RuntimeError("the model's fused LM head computes no entropy (add_fused_lm_head outputs)")
    return logps, out.entropy[0][at]


def packed_logprobs(model, inputs: dict[str, Any], *, temperature: float = 1.0, score: str = "trained",
                    attn_implementation: str | None = None, forward_model=None, with_entropy: bool = False):
    """Log-probability (M,) of every loss term of a packed micro-batch, from one forward over its row.

    ``score="trained"``: the LM head runs only at the positions whose next token is trained (a position
    shared by several samples is scored once and read by all of them); ``"all"``: at every position, as
    TRL's fused head does off Triton devices. ``forward_model``: a wrapper of ``model`` (DDP) whose forward
    must run so its gradient hooks fire: the whole causal LM is called through it (its LM head on one
    position only) and the backbone's output is taken with a forward hook. ``with_entropy``: also the
    entropy (M,) of each term's distribution (TRL logs it); returns (logps, entropies) then.

    A model sharded by FSDP2 (:func:`is_sharded`) is scored by TRL's fused LM head inside its forward
    (:func:`_sharded_logprobs`; its temperature is the one the trainer installed it with): reading
    ``head.weight`` here would see a DTensor shard."""
    if score not in ("trained", "all"):
        raise ValueError(f"score must be 'trained' or 'all', got {score!r}")
    name = attn_implementation or tree_attention_name(inputs["input_ids"].device)
    call = dict(input_ids=inputs["input_ids"][None], position_ids=inputs["position_ids"][None], use_cache=False,
                **tree_kwargs(inputs))
    use_tree_attention(model, name)  # for good: a checkpointed layer recomputes its forward in backward
    if is_sharded(forward_model if forward_model is not None else model):
        return _sharded_logprobs(forward_model if forward_model is not None else model, call, inputs, with_entropy)
    backbone, head, softcap = _causal_lm_parts(model)
    if forward_model is None:
        hidden = backbone(**call).last_hidden_state[0]
    else:
        captured = []
        hook = backbone.register_forward_hook(lambda _m, _a, out: captured.append(out.last_hidden_state))
        try:
            forward_model(**call, logits_to_keep=1)
        finally:
            hook.remove()
        hidden = captured[-1][0]
    labels = inputs["shift_labels"].to(head.weight.device)
    hidden = hidden.to(head.weight.device)
    outputs = ("entropy",) if with_entropy else ()
    if score == "trained":
        scored = labels != -100
        # loss term -> its position's rank among the scored positions
        rank = (torch.cumsum(scored, 0) - 1)[inputs["token_index"]]
        res = ChunkedLogProbFunction.apply(hidden[scored], head.weight, head.bias, labels[scored], temperature,
                                           VOCAB_CHUNK, softcap, 1.0, outputs)
    else:
        rank = inputs["token_index"]
        res = ChunkedLogProbFunction.apply(hidden, head.weight, head.bias, labels.clamp(min=0), temperature,
                                           VOCAB_CHUNK, softcap, 1.0, outputs)
    if with_entropy:
        return res[0][rank], res[1][rank]
    return res[0][rank]


def per_sample_logprobs(logps: torch.Tensor, inputs: dict[str, Any], n_samples: int) -> list[list[float]]:
    """Loss-term log-probabilities regrouped per batch sample (completion order), e.g. to compare paths."""
    out: list[list[float]] = [[] for _ in range(n_samples)]
    for i, v in zip(inputs["sample_index"].tolist(), logps.tolist(), strict=True):
        if i >= 0:
            out[i].append(v)
    return out


# --------------------------------------------------------------------------- loss


def token_weights(episode_of_sample: Sequence[int], trained_tokens: Sequence[int], mode: str = "token", *,
                  total_tokens: int | None = None, total_episodes: int | None = None) -> list[float]:
    """Loss weight of each trained token of each sample (one number per sample).

    ``"token"``: 1 / total trained tokens (``total_tokens``: over all ranks; default this batch's), the
    global token mean of TRL's ``loss_type="dapo"``: an episode weighs as many tokens as it produced.
    ``"episode"``: 1 / (episodes x trained tokens of the sample's episode) (``total_episodes``: episodes
    with trained tokens over all ranks; default this batch's), so every episode adds up to the same
    weight, whatever its number of steps. An episode lives on one rank, so its token count is local."""
    if mode not in ("token", "episode"):
        raise ValueError(f"mode must be 'token' or 'episode', got {mode!r}")
    if len(episode_of_sample) != len(trained_tokens):
        raise ValueError("episode_of_sample and trained_tokens differ in length")
    if mode == "token":
        total = total_tokens if total_tokens is not None else sum(trained_tokens)
        return [1.0 / max(total, 1)] * len(trained_tokens)
    per_episode: dict[int, int] = {}
    for e, n in zip(episode_of_sample, trained_tokens, strict=True):
        per_episode[e] = per_episode.get(e, 0) + n
    episodes = total_episodes if total_episodes is not None else sum(1 for n in per_episode.values() if n)
    return [1.0 / (max(episodes, 1) * per_episode[e]) if per_episode[e] else 0.0 for e in episode_of_sample]


def grpo_loss(logps: torch.Tensor, inputs: dict[str, Any], sample_weights: torch.Tensor, *,
              epsilon_low: float = 0.2, epsilon_high: float = 0.28, old_logps: torch.Tensor | None = None
              ) -> torch.Tensor:
    """Clipped GRPO objective summed over the loss terms, each weighted by its sample's weight
    (``sample_weights``, indexed by batch sample). ``old_logps`` default: ``logps`` detached (one
    iteration per generation, as TRL); the phantom term of an empty micro-batch has weight 0."""
    old = logps.detach() if old_logps is None else old_logps
    idx = inputs["sample_index"]
    w = torch.where(idx >= 0, sample_weights.to(logps.device)[idx.clamp(min=0)], torch.zeros_like(logps))
    adv = inputs["advantages"].to(logps.dtype)
    ratio = torch.exp(logps - old)
    per_term = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv)
    return (per_term * w).sum()


# --------------------------------------------------------------------------- dtype


def apply_auto_bf16(config) -> None:
    """A recipe's ``auto_bf16``: bf16 autocast where the training device has native bf16, fp32 elsewhere
    (sets ``bf16``, clears ``fp16``) and prints the choice, so the run's settings show it."""
    import sys

    device = "cuda" if torch.cuda.is_available() and not getattr(config, "use_cpu", False) else "cpu"
    config.bf16, config.fp16 = autocast_dtype(device) == torch.bfloat16, False
    print(f"auto_bf16: {device} {'has' if config.bf16 else 'lacks'} native bf16, training in "
          f"{'bf16 autocast' if config.bf16 else 'fp32'} (bf16={config.bf16})", file=sys.stderr)
