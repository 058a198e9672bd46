"""Launched by tests/test_packed_trainer.py under ``accelerate launch`` (2 gloo ranks): one generation batch
per rank with a different number of step samples (rank 1 drops its zero-advantage group), the packed update
against TRL's padded rows under DDP. Writes one JSON line per rank to argv[2]: packed micro-batches planned
locally and run per micro-step, the loss of each path and the gradients' agreement."""

import json
import sys

import torch
import torch.distributed as dist

from atommem_rl.training.grpo import StepwiseGRPOTrainer, build_trainer
from trl.trainer.utils import split_tensor_dict

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from tests.test_grpo import small_config  # noqa: E402

SCRIPTED = {0: [0.7, -0.3, 0.5, -0.9], 1: [0.4, -0.4, 0.0, 0.0]}


def main(tiny: str, out: str, folder: str) -> None:
    rank_of = {}
    StepwiseGRPOTrainer._advantages = lambda self, recs, *a: SCRIPTED[self.accelerator.process_index][: len(recs)]
    trainer = build_trainer(small_config(tiny, folder, synth_tasks=2, steps_per_generation=2,
                                         gradient_accumulation_steps=2, zero_advantage="drop"))
    acc = trainer.accelerator
    rank = acc.process_index
    model = acc.prepare_model(trainer.model)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    rows = [trainer.train_dataset[0]] * 2 + [trainer.train_dataset[1]] * 2
    batch = trainer._generate_and_score_completions(rows)

    def grads(steps):
        model.zero_grad(set_to_none=True)
        total = 0.0
        for inputs in steps:
            loss = trainer.compute_loss(model, inputs)
            acc.backward(loss)
            total += loss.item()
        return total, torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]).clone()

    row_loss, g_row = grads(split_tensor_dict(batch, 2))
    lengths = (batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1)).tolist()
    trainer.args.max_tokens_per_microbatch = int(max(lengths)) + 64
    from atommem_rl.training.packing import plan_microbatches  # noqa: F401  (planned count below)

    steps = trainer._pack_generation_batch(batch)
    planned = sum(1 for s in steps for m in s["packed_microbatches"] if m["rows"]["completion_mask"].sum() > 0)
    pk_loss, g_pk = grads(steps)
    rank_of.update(rank=rank, samples=int((batch["completion_mask"].sum(1) > 0).sum()), planned=planned,
                   per_step=[len(s["packed_microbatches"]) for s in steps], row_loss=row_loss, packed_loss=pk_loss,
                   cosine=torch.nn.functional.cosine_similarity(g_row, g_pk, dim=0).item(),
                   max_diff=(g_row - g_pk).abs().max().item(), grad_max=g_row.abs().max().item(),
                   grad_sum=g_pk.double().sum().item())
    with open(out, "a") as f:
        f.write(json.dumps(rank_of) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
