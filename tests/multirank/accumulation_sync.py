"""Launched by tests/test_grpo_ranks.py under ``accelerate launch`` (2 gloo ranks, DDP): one optimizer step of the
real ``StepwiseGRPOTrainer`` (``Trainer.train``, its accumulation loop, DDP, AdamW) over two micro-steps
(``gradient_accumulation_steps: 2``) whose inputs are scripted, so the step reaches the case under test: the first
micro-step carries advantages that differ between the ranks (so their local gradients differ), the last one is all
zero on every rank, which the ``zero_advantage`` skip takes without a forward. Only the inputs are scripted (the
rollouts are not what is tested); the loss, the backward, DDP's reduction and the optimizer are the product's.

    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml tests/multirank/accumulation_sync.py OUT MODEL MODE

Writes every rank's trainable weights after the step to OUT/rank{r}.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from atommem_rl.training.grpo import GRPORecipeConfig, build_trainer  # noqa: E402


def scripted_inputs(trainer, rank: int, micro_step: int) -> dict:
    """A micro-batch of 2 rows of real token ids: advantages +-(rank + 1) on micro-step 0, zeros after."""
    tok = trainer.processing_class
    prompts = [tok.encode(f"Rank {rank} stores fact {i}.", add_special_tokens=False) for i in range(2)]
    completions = [tok.encode(f"<tool_call>create {rank} {i} {micro_step}</tool_call>", add_special_tokens=False)
                   for i in range(2)]
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    pad = tok.pad_token_id
    prompt_ids = torch.tensor([[pad] * (width_p - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c + [pad] * (width_c - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in completions])
    adv = torch.tensor([rank + 1.0, -(rank + 1.0)]) if micro_step == 0 else torch.zeros(2)
    # TRL's dapo normaliser: the trained tokens of the whole step, over both ranks and both micro-steps
    tokens = trainer.accelerator.gather(completion_mask.sum().reshape(1)).sum() * 2
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": adv, "num_items_in_batch": tokens}


def main(out: str, model: str, mode: str) -> None:
    config = GRPORecipeConfig(
        model_name_or_path=model, output_dir=str(Path(out) / "run"), use_cpu=True, bf16=False, report_to="none",
        per_device_train_batch_size=2, num_generations=2, gradient_accumulation_steps=2, steps_per_generation=2,
        max_steps=1, save_strategy="no", logging_steps=1, learning_rate=1e-2, gradient_checkpointing=False,
        synth_tasks=8, synth_docs=1, synth_questions=1, synth_confounders=0, zero_advantage=mode, seed=0,
        env_config={"chunk_tokens": 64, "max_prompt_tokens": 2048, "max_answer_steps": 1})
    trainer = build_trainer(config)
    rank = trainer.accelerator.process_index
    calls = iter(range(10))
    trainer._prepare_inputs = lambda batch: scripted_inputs(trainer, rank, next(calls))
    skipped, decide = [], trainer._all_advantages_zero  # which micro-steps took the skip (logging clears _metrics)
    trainer._all_advantages_zero = lambda inputs: skipped.append(float(decide(inputs))) or bool(skipped[-1])
    trainer.train()
    inner = trainer.accelerator.unwrap_model(trainer.model)
    weights = {n: p.detach().clone() for n, p in inner.named_parameters() if p.requires_grad}
    torch.save({"weights": weights, "skipped": skipped},
               Path(out) / f"rank{rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:4])
