"""Step-wise PPO for memory episodes: a critic, GAE over the steps of an episode, clipped losses.

TRL 1.16 no longer ships a PPOTrainer, so PPO here reuses the step-wise GRPO machinery
(``training/grpo.py``: episodes as generation batches, one sample per step, TRL's clipped policy
loss, its KL term against a reference model when ``beta > 0``, its vLLM and accelerate paths) and
changes only where advantages come from:

  1. the critic V (a separate sequence-regression model, by default initialised from the policy
     checkpoint with a fresh scalar head; ``value_model`` may name a smaller one sharing the
     tokenizer) scores every step's prompt s_t;
  2. rewards per step r_t come from the environment (format penalties on any step; the terminal
     task reward, e.g. exact match, on the last step);
  3. GAE: delta_t = r_t + gamma * V(s_{t+1}) - V(s_t) (V = 0 after the last step),
     A_t = delta_t + gamma * lambda * A_{t+1}; returns G_t = A_t + V(s_t);
  4. the critic is fitted to G_t with the clipped value loss
     max((V - G)^2, (V_old + clip(V - V_old, -c, c) - G)^2) for ``critic_epochs`` passes;
  5. each step's completion tokens get A_t (whitened over the batch unless disabled), and the
     policy is updated with TRL's clipped surrogate (``epsilon``, ``epsilon_high``).

Launch:
    atommem ppo --config recipes/quickstart/ppo.yaml
    accelerate launch --config_file recipes/accelerate/zero3.yaml -m atommem_rl.cli ppo --config recipes/qwen3_8b/ppo.yaml
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import ClassVar
from pathlib import Path

import torch

from . import grpo
from .grpo import GRPORecipeConfig, StepwiseGRPOTrainer
from .recipes import parse_recipe_args


CRITIC_DIR = "critic"  # <output_dir>/critic and <output_dir>/checkpoint-N/critic
CRITIC_OPTIMIZER = "optimizer.pt"


@dataclass
class PPORecipeConfig(GRPORecipeConfig):
    """``GRPORecipeConfig`` plus the critic and GAE; ``output_dir`` = <checkpoints_dir>/<run_name>/ppo."""

    # sub-folders a checkpoint-N must hold to be resumed from (training/checkpoints.py)
    checkpoint_parts: ClassVar[tuple[str, ...]] = (CRITIC_DIR,)

    # TRL's GRPOConfig insists on >= 2 episodes per task; PPO treats them as independent samples
    num_generations: int | None = field(default=2, metadata={"help": "Episodes per task (>= 2, independent)."})
    gamma: float = field(default=1.0, metadata={"help": "Discount over the steps of an episode."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda."})
    value_model: str | None = field(
        default=None, metadata={"help": "Critic checkpoint (None: initialised from the policy checkpoint)."})
    critic_learning_rate: float = field(default=1e-5, metadata={"help": "Critic AdamW learning rate."})
    critic_epochs: int = field(default=2, metadata={"help": "Critic passes over each rollout batch."})
    critic_batch_size: int = field(default=8, metadata={"help": "Step prompts per critic forward."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Value clipping range around the old value."})
    whiten_advantages: bool = field(default=True, metadata={"help": "Normalise advantages over the batch."})

    def __post_init__(self):
        if self.output_dir is None:
            self.output_dir = str(Path(self.checkpoints_dir) / (self.run_name or "atommem") / "ppo")
        super().__post_init__()
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise ValueError("gamma and lam must be in [0, 1]")
        if self.critic_epochs < 0 or self.critic_batch_size < 1:
            raise ValueError("critic_epochs must be >= 0 and critic_batch_size >= 1")


def gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """(advantages, returns) of one episode by Generalised Advantage Estimation; V = 0 after the end."""
    adv = [0.0] * len(rewards)
    running = 0.0
    for t in reversed(range(len(rewards))):
        next_v = values[t + 1] if t + 1 < len(values) else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    return adv, [a + v for a, v in zip(adv, values)]


class StepwisePPOTrainer(StepwiseGRPOTrainer):
    """Step-wise trainer with a critic and per-step GAE advantages (see the module docstring)."""

    def __init__(self, *args, critic=None, critic_config: PPORecipeConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = critic_config
        self.gamma, self.lam = cfg.gamma, cfg.lam
        self.cliprange_value, self.critic_epochs = cfg.cliprange_value, cfg.critic_epochs
        self.critic_batch_size, self.whiten = cfg.critic_batch_size, cfg.whiten_advantages
        optimizer = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_learning_rate)
        # the critic is a second model under the same accelerator: DDP/FSDP/DeepSpeed wrap it too
        self.critic, self.critic_optimizer = self.accelerator.prepare(critic, optimizer)

    # -- the critic is part of every checkpoint-N: a resumed run restores its weights and optimizer
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Trainer saves optimizer/scheduler here, before trainer_state.json (written last, so a
        checkpoint killed mid-save fails the resume check): the critic and its optimizer go alongside."""
        super()._save_optimizer_and_scheduler(output_dir)
        if self.accelerator.is_main_process:
            folder = Path(output_dir) / CRITIC_DIR
            self.accelerator.unwrap_model(self.critic).save_pretrained(folder)
            torch.save(self.critic_optimizer.state_dict(), folder / CRITIC_OPTIMIZER)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        folder = Path(checkpoint) / CRITIC_DIR
        if not (folder / CRITIC_OPTIMIZER).exists():
            from ..models import CheckpointError

            raise CheckpointError(f"PPO checkpoint {checkpoint} has no critic ({folder / CRITIC_OPTIMIZER})")
        critic = self.accelerator.unwrap_model(self.critic)
        saved = type(critic).from_pretrained(folder, dtype=next(critic.parameters()).dtype)
        critic.load_state_dict(saved.state_dict())
        self.critic_optimizer.load_state_dict(torch.load(folder / CRITIC_OPTIMIZER, weights_only=True,
                                                         map_location=self.accelerator.device))

    def _values(self, prompts: list[list[int]], grad: bool = False) -> torch.Tensor:
        pad_id = self._tokenizer.pad_token_id
        out = []
        for i in range(0, len(prompts), self.critic_batch_size):
            chunk = prompts[i : i + self.critic_batch_size]
            width = max(len(p) for p in chunk)
            # right padding: sequence-classification heads read the last non-pad token
            ids = torch.tensor([p + [pad_id] * (width - len(p)) for p in chunk], device=self.accelerator.device)
            mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in chunk], device=self.accelerator.device)
            with torch.set_grad_enabled(grad):
                out.append(self.critic(input_ids=ids, attention_mask=mask).logits.squeeze(-1).float())
        return torch.cat(out) if out else torch.zeros(0, device=self.accelerator.device)

    def _fit_critic(self, prompts: list[list[int]], returns: torch.Tensor, old: torch.Tensor) -> float:
        losses = []
        self.critic.train()
        for _ in range(self.critic_epochs):
            order = torch.randperm(len(prompts)).tolist()
            for i in range(0, len(order), self.critic_batch_size):
                idx = order[i : i + self.critic_batch_size]
                v = self._values([prompts[j] for j in idx], grad=True)
                g, v_old = returns[idx], old[idx]
                clipped = v_old + torch.clamp(v - v_old, -self.cliprange_value, self.cliprange_value)
                loss = 0.5 * torch.max((v - g) ** 2, (clipped - g) ** 2).mean()
                self.critic_optimizer.zero_grad()
                self.accelerator.backward(loss)
                self.critic_optimizer.step()
                losses.append(loss.item())
        return sum(losses) / max(len(losses), 1)

    def _advantages(self, recs, episodes, all_returns, group):
        prompts = [p for steps in episodes for (p, _, _) in steps]
        self.critic.eval()
        values = self._values(prompts).tolist()
        per_episode, flat_returns, flat_adv, k = [], [], [], 0
        for rec, steps in zip(recs, episodes, strict=True):
            rewards = [float(s["reward"]) for s in rec["steps"][: len(steps)]]
            adv, ret = gae(rewards, values[k : k + len(steps)], self.gamma, self.lam)
            k += len(steps)
            per_episode.append(adv)
            flat_adv.extend(adv)
            flat_returns.extend(ret)
        device = self.accelerator.device
        mode = "train" if self.model.training else "eval"
        if mode == "train" and self.critic_epochs > 0 and prompts:
            loss = self._fit_critic(prompts, torch.tensor(flat_returns, device=device),
                                    torch.tensor(values, device=device))
            # logged by the main process: the mean over all processes, as for the rewards
            self._metrics[mode]["critic/value_loss"].append(
                self.accelerator.gather(torch.tensor([loss], device=device)).mean().item())
        # the mean over every process's steps (a local mean would log rank 0's half only)
        total = self.accelerator.gather(torch.tensor([sum(values), float(len(values))], device=device)).view(-1, 2).sum(0)
        self._metrics[mode]["critic/value_mean"].append((total[0] / total[1].clamp(min=1.0)).item())
        if self.whiten and flat_adv:
            stats = self.accelerator.gather(torch.tensor([sum(flat_adv), sum(a * a for a in flat_adv),
                                                          float(len(flat_adv))], device=device)).view(-1, 3).sum(0)
            mean = stats[0] / stats[2]
            std = torch.sqrt(torch.clamp(stats[1] / stats[2] - mean**2, min=0.0)) + 1e-6
            per_episode = [[(a - mean.item()) / std.item() for a in adv] for adv in per_episode]
        return per_episode


def build_critic(config: PPORecipeConfig):
    from transformers import AutoModelForSequenceClassification, set_seed

    from ..models import check_checkpoint

    path = check_checkpoint(config.value_model or config.model_name_or_path)
    # the scalar head is new: initialise it from the run's seed (it was built before Trainer seeds the
    # RNG, so two runs with one seed, or 1 and 2 processes, started from different critics)
    set_seed(config.seed)
    critic = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    if critic.config.pad_token_id is None:
        critic.config.pad_token_id = critic.config.eos_token_id
    return critic


def build_trainer(config: PPORecipeConfig) -> StepwisePPOTrainer:
    return grpo.build_trainer(config, StepwisePPOTrainer, critic=build_critic(config), critic_config=config)


def save_critic(trainer: StepwisePPOTrainer) -> None:
    if trainer.accelerator.is_main_process:
        trainer.accelerator.unwrap_model(trainer.critic).save_pretrained(Path(trainer.args.output_dir) / CRITIC_DIR)


def train(config: PPORecipeConfig) -> dict:
    """Run PPO; the critic is saved next to the policy under <output_dir>/critic, and with its
    optimizer under every <output_dir>/checkpoint-N/critic (a resume restores both)."""
    return grpo.train(config, build=build_trainer, phase="ppo", on_trained=save_critic)


def main(argv: list[str] | None = None) -> int:
    config = parse_recipe_args(PPORecipeConfig, argv)
    print(json.dumps(train(config), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
