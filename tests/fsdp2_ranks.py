"""Launched by tests/test_fsdp2_packing.py under ``accelerate launch`` (2 gloo ranks): the real trainer's packed
update and packed no-gradient passes under FSDP2 (recipes/accelerate/fsdp2_cpu.yaml with
ATOMMEM_REHEARSE_FSDP_ON_CPU=1: accelerate's own ``fully_shard`` preparation) or DDP (cpu_2proc.yaml), on one
generation batch per rank with a different number of step samples (rank 1 drops its zero-advantage group).

Per rank it writes one JSON line to <out>/ranks.jsonl: the packed micro-batches planned and run per
micro-step; per phase (old-policy pass, reference pass, row update, packed update) the root module's forwards,
FSDP2's parameter all-gathers and gradient reduce-scatters, counted by hooks on the model and on the two
``torch.distributed`` functions FSDP2 calls; packed against TRL's rows: log-probabilities and gradients. Rank 0
saves the full (all-reduced, unsharded) gradients of both paths to <out>/<mode>_grads.pt for the DDP comparison.
The micro-steps run as the Trainer runs them: all but the last under ``accelerator.no_sync`` with
``sync_gradients`` off, so gradients reduce once per optimizer step.

    accelerate launch --config_file recipes/accelerate/fsdp2_cpu.yaml tests/fsdp2_ranks.py TINY OUT RUN fsdp2
"""

import collections
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from atommem_rl.training.grpo import StepwiseGRPOTrainer, build_trainer  # noqa: E402
from tests.test_grpo import small_config  # noqa: E402

SCRIPTED = {0: [0.7, -0.3, 0.5, -0.9], 1: [0.4, -0.4, 0.0, 0.0]}
COUNTS: collections.Counter = collections.Counter()


def count_collectives() -> None:
    """Count FSDP2's parameter all-gathers and gradient reduce-scatters (torch 2.13 calls them through these)."""
    for name in ("all_gather_single", "reduce_scatter_single"):
        original = getattr(dist, name)

        def counted(*a, _original=original, _name=name, **k):
            COUNTS[_name] += 1
            return _original(*a, **k)

        setattr(dist, name, counted)


@contextlib.contextmanager
def phase(name: str, out: dict):
    """Record the root forwards and FSDP2 collectives of one phase into ``out[name]``."""
    COUNTS.clear()
    t0 = time.perf_counter()
    yield
    out[name] = {"forwards": COUNTS["forward"], "all_gathers": COUNTS["all_gather_single"],
                 "reduce_scatters": COUNTS["reduce_scatter_single"]}
    out.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)


def full_grads(model) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return torch.cat([(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).flatten()
                      for p in model.parameters() if p.requires_grad]).detach().clone()


def update(trainer, model, micro_steps, each_batch: bool = False) -> float:
    """One optimizer step's backwards, as the Trainer's loop runs them (sync only on the last micro-step; with
    accelerate's ``sync_each_batch`` no micro-step runs under ``no_sync``)."""
    acc = trainer.accelerator
    acc.gradient_state.plugin_kwargs["sync_each_batch"] = each_batch
    model.zero_grad(set_to_none=True)
    total = 0.0
    for i, inputs in enumerate(micro_steps):
        last = i == len(micro_steps) - 1
        acc.gradient_state._set_sync_gradients(last)
        with contextlib.nullcontext() if last or each_batch else acc.no_sync(model):
            loss = trainer.compute_loss(model, inputs)
            acc.backward(loss)
        total += loss.item()
    return total


def main(tiny: str, out: str, folder: str, mode: str) -> None:
    from trl.trainer.utils import split_tensor_dict

    StepwiseGRPOTrainer._advantages = lambda self, recs, *a: SCRIPTED[self.accelerator.process_index][: len(recs)]
    trainer = build_trainer(small_config(tiny, folder, synth_tasks=2, steps_per_generation=2,
                                         gradient_accumulation_steps=2, zero_advantage="drop", beta=0.04))
    acc = trainer.accelerator
    rank = acc.process_index
    assert acc.is_fsdp2 == (mode == "fsdp2"), acc.distributed_type
    count_collectives()
    if acc.is_fsdp2:  # as the Trainer does under FSDP2: model and optimizer together
        trainer.create_optimizer()
        model, trainer.optimizer = acc.prepare(trainer.model, trainer.optimizer)
        trainer.model = trainer.model_wrapped = model
    else:
        model = acc.prepare_model(trainer.model)
    for m in (model, trainer.ref_model):  # the root modules: one call per forward that gathers parameters
        if m is not None:
            m.register_forward_pre_hook(lambda *_: COUNTS.update(["forward"]))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    rows = [trainer.train_dataset[0]] * 2 + [trainer.train_dataset[1]] * 2
    t0 = time.perf_counter()
    batch = trainer._generate_and_score_completions(rows)  # packing off: TRL's row passes (ref model)
    t_gen = time.perf_counter() - t0
    mask = batch["completion_mask"].bool()
    res: dict = {"rank": rank, "mode": mode, "samples": int(mask.any(1).sum())}
    torch.save({k: v for k, v in batch.items() if torch.is_tensor(v)}, Path(out) / f"{mode}_batch{rank}.pt")

    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    att = torch.cat([batch["prompt_mask"], torch.ones_like(batch["completion_mask"])], dim=1)
    with torch.no_grad(), phase("row_scores", res):
        old_rows = trainer._get_per_token_logps_and_entropies(model, ids, att, ids.size(1) - batch["prompt_ids"].size(1),
                                                              batch_size=4)[0]
    lengths = (batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1)).tolist()
    trainer.args.max_tokens_per_microbatch = int(max(lengths)) + 64  # several packed micro-batches per micro-step
    with phase("old", res):
        old_packed = trainer._packed_scores(batch, model)
    with phase("ref", res):
        ref_packed = trainer._packed_ref_logps(batch)
    res["old_logp_diff"] = (old_packed - old_rows)[mask].abs().max().item()
    res["ref_logp_diff"] = (ref_packed - batch["ref_per_token_logps"])[mask].abs().max().item()

    trainer.args.max_tokens_per_microbatch = 0
    with phase("rows", res):
        row_loss = update(trainer, model, split_tensor_dict(batch, 2))
    g_row = full_grads(model)
    trainer.args.max_tokens_per_microbatch = int(max(lengths)) + 64
    steps = trainer._pack_generation_batch(batch)
    with phase("packed", res):
        pk_loss = update(trainer, model, steps)
    g_pk = full_grads(model)
    with phase("each_batch", res):  # sync_each_batch: every packed backward reduces, the same gradients
        update(trainer, model, steps, each_batch=True)
    g_each = full_grads(model)

    # FSDP2's parameter groups (a group may span modules: accelerate's tail group holds norm, embedding, head)
    groups = {id(m._get_fsdp_state()._fsdp_param_group) for m in model.modules() if hasattr(m, "_get_fsdp_state")
              and m._get_fsdp_state()._fsdp_param_group is not None} if acc.is_fsdp2 else set()
    res.update(planned=sum(1 for s in steps for m in s["packed_microbatches"] if m["rows"]["completion_mask"].sum() > 0),
               per_step=[len(s["packed_microbatches"]) for s in steps], fsdp_groups=len(groups),
               row_loss=row_loss, packed_loss=pk_loss, grad_max=g_row.abs().max().item(),
               cosine=torch.nn.functional.cosine_similarity(g_row, g_pk, dim=0).item(),
               max_diff=(g_row - g_pk).abs().max().item(), grad_sum=g_pk.double().sum().item(),
               each_batch_diff=(g_each - g_pk).abs().max().item())
    res["seconds"].update(rollouts=round(t_gen, 1), total=round(time.perf_counter() - t0, 1))
    if rank == 0:
        torch.save({"rows": g_row, "packed": g_pk}, Path(out) / f"{mode}_grads.pt")
    with open(Path(out) / "ranks.jsonl", "a") as f:
        f.write(json.dumps(res) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
