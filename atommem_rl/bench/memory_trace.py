"""Traced per-rank memory of one training step under FSDP2, on fake tensors: the measured part of the memory plan.

What. :func:`trace_step` builds a transformers model (the policy, a causal LM, or the PPO critic, a
sequence-classification model) under ``FakeTensorMode`` on fake CPU tensors (shapes and dtypes, no
storage), shards it as accelerate's FSDP2 preparation does (``fully_shard`` per decoder layer, then the
root; fp32 master weights, bf16 compute and reduction: accelerate's ``MixedPrecisionPolicy`` for
``mixed_precision: bf16``) over a fake process group of ``world`` ranks (``torch``'s ``fake`` backend:
collectives return at once with the right shapes), and runs the update under torch's own
``FSDPMemTracker`` (``torch.distributed._tools``): micro-step 1 (forward, backward, AdamW step), then,
with the gradients kept as gradient accumulation keeps them and the optimizer state made, micro-step 2,
whose peak is reported. The forwards are the project's and TRL's own:

* ``packed``: a prefix-shared micro-batch (``training/packing.py``: ``microbatch_inputs``,
  ``packed_logprobs`` through the sharded root, tree attention, TRL's chunked LM head on the trained
  positions) of ``tokens`` unique tokens;
* ``padded``: TRL's padded rows (``rows`` x ``width``, prompt left-padded, ``completion`` trained tokens
  per row) through TRL's fused LM head (``add_fused_lm_head``), as ``GRPOTrainer`` runs them;
* ``critic``: PPO's critic chunk (``rows`` x ``width`` padded tokens, a value per row, squared error).

The packed layout (token ids, positions, tree indices, labels) is data, not model memory: it stays in
real tensors and every op whose tensors are all real runs for real (:class:`RealLayout`), so the tree
kernel can read its segment bounds; only model, activation, gradient and optimizer tensors are fake.

:func:`lm_head_working_set` traces TRL's ``ChunkedLogProbFunction`` alone (forward and backward over the
scored positions): the logits term of the plan. :func:`rss_step` runs the same step for real on CPU
(no fake tensors) and reports the peak resident memory over its loaded baseline (``VmHWM`` reset through
``/proc/self/clear_refs`` after loading), the instrument the tracker is checked against.

    from atommem_rl.bench.memory_trace import trace_step, qwen3_config
    trace_step(qwen3_config(layers=2), "packed", world=6, tokens=16384)   # -> {"components": ..., "peak": ...}
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

# Qwen3-8B (its config.json): the plan's model unless a recipe's model folder has a config
QWEN3_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                vocab_size=151936, num_hidden_layers=36, tie_word_embeddings=False, rope_theta=1000000,
                max_position_embeddings=40960, rms_norm_eps=1e-6)

# FSDPMemTracker's reference types grouped into the plan's components
COMPONENTS = {
    "parameters": ("Sharded Param", "Unsharded Param", "Buffer", "All Gather"),
    "gradients": ("Sharded Grad", "Unsharded Grad", "Reduce Scatter"),
    "optimizer_state": ("OptState",),
    "activations": ("Activation", "Inputs"),
    "temporaries": ("Temp",),
}
KINDS = ("packed", "padded", "critic")


def qwen3_config(layers: int | None = None, **overrides):
    """transformers ``Qwen3Config`` of Qwen3-8B (``layers``: fewer decoder layers, for the per-layer fit)."""
    from transformers import Qwen3Config

    kw = {**QWEN3_8B, **overrides}
    if layers is not None:
        kw["num_hidden_layers"] = layers
    config = Qwen3Config(**kw)
    config._attn_implementation = "sdpa"
    return config


class RealLayout(torch.utils._python_dispatch.TorchDispatchMode):
    """Ops whose tensors are all real (the packed layout: ids, positions, tree indices, masks) run for real, so
    data-dependent reads of the layout (``tolist``, boolean masks) work; a real boolean mask that indexes a
    fake tensor becomes its real index list. Everything else goes on to the tracker and the fake mode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils._python_dispatch import _disable_current_modes

        kwargs = kwargs or {}
        tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if tensors and not any(isinstance(x, FakeTensor) for x in tensors):
            with _disable_current_modes():
                return func(*args, **kwargs)
        if func is torch.ops.aten.index.Tensor:
            index = list(args[1])
            for i, t in enumerate(index):
                if t is not None and t.dtype == torch.bool and t.dim() == 1 and not isinstance(t, FakeTensor):
                    with _disable_current_modes():
                        index[i] = t.nonzero().squeeze(-1)
            args = (args[0], index, *args[2:])
        return func(*args, **kwargs)


def fake_mesh(world: int):
    """A 1-D device mesh over a fake process group of ``world`` ranks, this process rank 0 (torch's ``fake``
    backend: collectives return at once, with the right shapes). A group of another size is replaced."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized() and dist.get_world_size() != world:
        dist.destroy_process_group()
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    return init_device_mesh("cpu", (world,))


def _shard(model, mesh, bf16: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.bfloat16)
          if bf16 else MixedPrecisionPolicy())
    for layer in model.model.layers:  # accelerate's TRANSFORMER_BASED_WRAP: one group per decoder layer
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def packed_inputs(tokens: int, completion: int, pad_token_id: int = 0) -> dict[str, Any]:
    """A packed micro-batch of ``tokens`` unique tokens (TRL's ``TreeRow``): one group whose samples share a
    prompt of ``tokens - k * completion`` tokens and have ``k`` completions of ``completion`` tokens, ``k`` as
    many as leave the prompt at least one completion long: the most trained (scored) tokens a micro-batch of
    that budget holds, the LM head's worst case."""
    from trl.experimental.async_grpo.packing import TreeRow

    from atommem_rl.training.packing import microbatch_inputs, tree_samples

    completion = max(1, min(completion, tokens // 2))
    k = max(1, tokens // completion - 1)
    prompt = tokens - k * completion
    samples = [(list(range(1, prompt + 1)), [prompt + 1 + (i * completion + j) % 1000 + i for j in range(completion)],
                None, 1.0) for i in range(k)]
    row = TreeRow()
    for s in tree_samples(samples, [0] * k):
        row.add(s)
    return microbatch_inputs(row, pad_token_id)


def padded_inputs(rows: int, width: int, completion: int) -> dict[str, torch.Tensor]:
    """TRL's padded rows: ``rows`` x ``width`` ids, the last ``completion`` positions of each row trained."""
    ids = torch.arange(rows * width).remainder(1000).add(1).view(rows, width)
    labels = torch.full_like(ids, -100)
    labels[:, -completion - 1:-1] = ids[:, -completion:]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "shift_labels": labels}


def _build(config, kind: str, checkpointing: bool):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config.use_cache = False
    if kind == "critic":
        config.num_labels, config.pad_token_id = 1, config.pad_token_id or 0
        model = AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        from trl.trainer.utils import add_fused_lm_head

        # as GRPOTrainer patches the policy; the packed update of a sharded model scores through it too
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _loss(model, kind: str, inputs) -> torch.Tensor:
    if kind == "packed":
        from atommem_rl.training.packing import packed_logprobs

        # through the sharded root (forward_model), so FSDP gathers the root's parameters, the LM head's too
        logps, _entropy = packed_logprobs(model, inputs, forward_model=model, with_entropy=True)
        return -logps.float().mean()
    if kind == "padded":
        out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                    shift_labels=inputs["shift_labels"], fused_lm_head=True)
        return -out.log_probs.float().sum() / max(int((inputs["shift_labels"] != -100).sum()), 1)
    values = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits.squeeze(-1)
    return values.float().pow(2).mean()


def step_inputs(kind: str, *, tokens: int = 0, rows: int = 1, width: int = 0, completion: int = 2048):
    """The micro-batch of ``kind`` (see the module docstring)."""
    if kind == "packed":
        return packed_inputs(tokens, completion)
    if kind == "padded":
        return padded_inputs(rows, width, min(completion, width - 1))
    ids = torch.arange(rows * width).remainder(1000).add(1).view(rows, width)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _components(snapshot: dict) -> dict[str, int]:
    by_name = {str(getattr(k, "value", k)): v for dev in snapshot.values() for k, v in dev.items()}
    out = {name: sum(by_name.get(r, 0) for r in refs) for name, refs in COMPONENTS.items()}
    out["total"] = sum(out.values())
    return out


RESIDENT = ("parameters", "gradients", "optimizer_state")


ACCUMULATION = ("sync", "no_sync")


def trace_step(config, kind: str, *, world: int, bf16: bool = True, checkpointing: bool = True,
               accumulation: str = "sync", **batch) -> dict:
    """Peak of a steady-state micro-step of ``kind`` on one of ``world`` ranks (bytes): ``components`` at the
    peak (they add up to ``peak``), ``resident`` (what stays between steps: sharded parameters, gradients,
    optimizer state), ``forwarded_tokens``.

    ``accumulation``: ``sync``, every backward reduce-scatters (accelerate's ``sync_each_batch``, or no
    accumulation); ``no_sync``, as the Trainer accumulates by default: the micro-steps before a window's last
    run under ``no_sync`` (FSDP2's ``set_requires_gradient_sync(False)``), which holds unsharded gradients in
    the compute dtype until the last backward. Micro-step 1 sets up the optimizer state; the peak reported is
    that of micro-step 2 (``sync``) or of micro-steps 2 and 3, the first under ``no_sync`` (``no_sync``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if accumulation not in ACCUMULATION:
        raise ValueError(f"accumulation must be one of {ACCUMULATION}, got {accumulation!r}")
    inputs = step_inputs(kind, **batch)
    mesh = fake_mesh(world)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _build(config, kind, checkpointing)
        _shard(model, mesh, bf16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        tracker = FSDPMemTracker(model, opt)
        with tracker, RealLayout():
            initial = _components(tracker.get_tracker_snapshot("current"))["total"]
            held = accumulation == "no_sync"
            for micro_step in range(3 if held else 2):
                model.set_requires_gradient_sync(not (held and micro_step == 1))
                _loss(model, kind, inputs).backward()
                if not (held and micro_step == 1):  # no optimizer step inside an accumulation window
                    opt.step()  # the gradients stay: the next micro-step accumulates onto them
                if micro_step == 1 and held:
                    tracker.reset_mod_stats()  # one iteration per module at a time; the peak carries on
                if micro_step == 0:
                    first = _components(tracker.get_tracker_snapshot("peak"))["total"]
                    # what stays between steps is the state alone: a step's last activation can still be
                    # referenced here (8 MB of the 1-layer trace, which bent the fit to 36 layers: Qwen3-8B's
                    # resident 20.08 GiB on 6 ranks, below its fp32 state's 20.35)
                    resident = _components(tracker.get_tracker_snapshot("current"))
                    resident = {k: resident[k] for k in RESIDENT}
                    resident["total"] = sum(resident.values())
                    tracker.reset_mod_stats()  # the tracker follows one iteration per module at a time
                    # and has no public reset of its peak; what follows is the steady state reported
                    tracker._peak_mem_snap, tracker._peak_mem = {}, {}
        peak = _components(tracker.get_tracker_snapshot("peak"))
    forwarded = inputs["forwarded_tokens"] if kind == "packed" else int(inputs["input_ids"].numel())
    return {"components": peak, "peak": peak["total"], "resident": resident, "forwarded_tokens": forwarded,
            "initial": initial, "peak_both_steps": max(first, peak["total"])}


def lm_head_working_set(config, scored: int, bf16: bool = True) -> int:
    """Peak bytes of TRL's ``ChunkedLogProbFunction`` (forward and backward over ``scored`` positions, vocabulary
    tiles of ``packing.VOCAB_CHUNK``) above its inputs (hidden states and the gathered head weight)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from trl.kernels import ChunkedLogProbFunction

    from atommem_rl.training.packing import VOCAB_CHUNK

    dtype = torch.bfloat16 if bf16 else torch.float32
    with FakeTensorMode():
        hidden = torch.empty(scored, config.hidden_size, dtype=dtype, requires_grad=True)
        weight = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, requires_grad=True)
        labels = torch.zeros(scored, dtype=torch.long)
        tracker = MemTracker()
        tracker.track_external(hidden, weight, labels)
        with tracker:
            base = _components(tracker.get_tracker_snapshot("current"))["total"]
            out = ChunkedLogProbFunction.apply(hidden, weight, None, labels, 1.0, VOCAB_CHUNK, None, 1.0, ("entropy",))
            out[0].sum().backward()
            peak = sum(v for dev in tracker.get_tracker_snapshot("peak").values() for k, v in dev.items()
                       if str(getattr(k, "value", k)) != "Total")
    return peak - base


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_step(model_dir: str, kind: str, **batch) -> dict:
    """The same two micro-steps on real CPU tensors, in this process (a gloo rank, or a group of one made
    here): ``model_dir``'s weights in fp32, FSDP2 without mixed precision. Returns the peak resident memory
    (``VmHWM``, reset after loading) over the loaded baseline (``VmRSS`` then), in bytes."""
    import gc

    from torch.distributed.device_mesh import init_device_mesh

    inputs = step_inputs(kind, **batch)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _build_real(model_dir, kind)
    _shard(model, mesh, bf16=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    gc.collect()
    baseline = _vm("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM (the peak) to the current RSS
        f.write("5")
    for _ in range(2):
        _loss(model, kind, inputs).backward()
        opt.step()
    return {"measured": _vm("VmHWM") - baseline, "baseline": baseline}


def _build_real(model_dir: str, kind: str):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if kind == "critic":
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32,
                                                                   attn_implementation="sdpa")
        model.config.pad_token_id = model.config.pad_token_id or 0
        model.config.use_cache = False
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _rss_worker(rank: int, world: int, port: int, model_dir: str, kind: str, batch: dict, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, rss_step(model_dir, kind, **batch)["measured"]))
    finally:
        dist.destroy_process_group()


def validate_case(model_dir: str, kind: str, ranks: int, repeats: int, **batch) -> dict:
    """Tracker (fake tensors, this process) against peak RSS over baseline of ``repeats`` real runs of
    ``ranks`` gloo processes (each a fresh process; the largest rank's figure per run; median of runs)."""
    import multiprocessing as mp
    import queue as queue_mod
    import statistics

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    traced = trace_step(config, kind, world=ranks, bf16=False, **batch)
    predicted = traced["peak_both_steps"] - traced["initial"]
    ctx = mp.get_context("spawn")
    # the instrument: glibc returns freed memory at once (large blocks mmapped, no trim threshold, one arena), so
    # the resident set follows the live tensors rather than the allocator's retained free blocks
    malloc = {"MALLOC_MMAP_THRESHOLD_": "262144", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_ARENA_MAX": "1"}
    runs = []
    for r in range(repeats):
        queue = ctx.Queue()
        port = 29600 + (os.getpid() + r) % 300
        procs = [ctx.Process(target=_rss_worker, args=(i, ranks, port, model_dir, kind, batch, queue))
                 for i in range(ranks)]
        saved = {k: os.environ.get(k) for k in malloc}
        os.environ.update(malloc)  # a spawned process takes the environment at start
        try:
            for p in procs:
                p.start()
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        got = []
        while len(got) < ranks:  # a rank that dies (out of memory, an error) must not leave us waiting
            try:
                got.append(queue.get(timeout=5))
            except queue_mod.Empty:
                dead = [p.exitcode for p in procs if p.exitcode]
                if dead:
                    for p in procs:
                        p.kill()
                    raise RuntimeError(f"a measuring process exited with {dead[0]}") from None
        for p in procs:
            p.join()
        runs.append(max(v for _, v in got))
    measured = statistics.median(runs)
    return {"kind": kind, "ranks": ranks, "forwarded_tokens": traced["forwarded_tokens"], "predicted": predicted,
            "measured": int(measured), "runs": runs, "error": round(predicted / measured - 1, 4)}
