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
    accelerate launch --config_file recipes/accelerate/fsdp2.yaml -m atommem_rl.cli ppo --config recipes/qwen3_8b/ppo.yaml
(DeepSpeed is refused before any model is loaded: see ``refuse_unsupported_ppo``.)
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
DEEPSPEED_REFUSED = ("atommem ppo does not run under DeepSpeed (the critic would be a second DeepSpeed engine); "
                     "launch it with recipes/accelerate/fsdp2.yaml or multi_gpu.yaml")


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
    critic_batch_size: int = field(default=8, metadata={"help": "Step prompts per critic forward (at most)."})
    critic_max_tokens: int = field(default=8192, metadata={
        "help": "Padded tokens per critic forward/backward (at most; a longer step prompt goes alone): bounds "
                "the critic's activation memory, which with 8 prompts of ~2K tokens outgrew a 24 GB machine."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Value clipping range around the old value."})
    whiten_advantages: bool = field(default=True, metadata={"help": "Normalise advantages over the batch."})

    def __post_init__(self):
        # first: TrainingArguments' own __post_init__ already sets DeepSpeed up (and fails without it installed)
        refuse_unsupported_ppo(self)
        if self.output_dir is None:
            self.output_dir = str(Path(self.checkpoints_dir) / (self.run_name or "atommem") / "ppo")
        super().__post_init__()
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise ValueError("gamma and lam must be in [0, 1]")
        if self.fork_credit:
            raise ValueError("fork_credit is GRPO's step-level credit; PPO's comes from its critic (GAE): set fork_credit: 0")
        if self.critic_epochs < 0 or self.critic_batch_size < 1 or self.critic_max_tokens < 1:
            raise ValueError("critic_epochs must be >= 0, critic_batch_size and critic_max_tokens >= 1")


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
    """Step-wise trainer with a critic and per-step GAE advantages (see the module docstring).

    The critic is a second model under the trainer's accelerator (DDP or FSDP wrap it like the policy).
    Every critic pass (values, fit) runs the same number of forwards and backwards on every rank,
    whatever each rank's number of steps: a rank with fewer chunks runs one-token chunks with no loss,
    because DDP reduces gradients in every backward and FSDP gathers parameters in every forward."""

    def __init__(self, *args, critic=None, critic_config: PPORecipeConfig | None = None, **kwargs):
        refuse_unsupported_ppo(critic_config)  # normally already refused by PPORecipeConfig, before any model loaded
        super().__init__(*args, **kwargs)
        from accelerate.utils import DistributedType

        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            raise ValueError(DEEPSPEED_REFUSED)
        cfg = critic_config
        self.gamma, self.lam = cfg.gamma, cfg.lam
        self.cliprange_value, self.critic_epochs = cfg.cliprange_value, cfg.critic_epochs
        self.critic_batch_size, self.whiten = cfg.critic_batch_size, cfg.whiten_advantages
        self.critic_max_tokens = cfg.critic_max_tokens
        if self.accelerator.scaler is not None:
            raise ValueError("PPO's critic does not support fp16 mixed precision (a second grad scaler); use bf16")
        if cfg.gradient_checkpointing:
            critic.gradient_checkpointing_enable(gradient_checkpointing_kwargs=cfg.gradient_checkpointing_kwargs
                                                 or {"use_reentrant": False})
        optimizer = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_learning_rate)
        self.critic, prepared = self.accelerator.prepare(critic, optimizer)
        # accelerate's optimizer wrapper steps only when the *trainer's* gradient accumulation says so
        # (sync_gradients), which is False on all but the last micro-step where the critic is fitted:
        # the critic is stepped on its own schedule, through the optimizer the wrapper holds
        self.critic_optimizer = getattr(prepared, "optimizer", prepared)
        self.critic_passes = {"forward": 0, "backward": 0}  # per rank; equal on every rank (tests check it)

    # -- the critic is part of every checkpoint-N: a resumed run restores its weights and optimizer
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Trainer saves optimizer/scheduler here on every rank, before trainer_state.json (written last, so
        a checkpoint killed mid-save fails the resume check): the critic and its optimizer go alongside."""
        super()._save_optimizer_and_scheduler(output_dir)
        save_critic_state(self, Path(output_dir) / CRITIC_DIR, optimizer=True)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        folder = Path(checkpoint) / CRITIC_DIR
        if not (folder / CRITIC_OPTIMIZER).exists():
            from ..models import CheckpointError

            raise CheckpointError(f"PPO checkpoint {checkpoint} has no critic ({folder / CRITIC_OPTIMIZER})")
        load_critic_state(self, folder)

    # -- critic passes with the same number of collectives on every rank
    def _chunks(self, prompts: list[list[int]], order: list[int]) -> list[list[int]]:
        """Indices of ``prompts`` in ``order``, cut into chunks of at most ``critic_batch_size`` prompts and
        ``critic_max_tokens`` padded tokens (a longer prompt goes alone), padded with empty chunks to the
        largest chunk count of any rank."""
        chunks: list[list[int]] = []
        for j in order:
            cur = chunks[-1] if chunks else None
            width = max([len(prompts[i]) for i in cur] + [len(prompts[j])]) if cur else 0
            if cur is None or len(cur) >= self.critic_batch_size or width * (len(cur) + 1) > self.critic_max_tokens:
                chunks.append([j])
            else:
                cur.append(j)
        n = len(chunks)
        if self.accelerator.num_processes > 1:
            n = int(self.accelerator.gather(torch.tensor([n], device=self.accelerator.device)).max())
        return chunks + [[] for _ in range(n - len(chunks))]

    def _critic_forward(self, chunk: list[list[int]]) -> torch.Tensor:
        """Values of a chunk of prompts; an empty chunk runs one padding token (its value is discarded)."""
        pad_id = self._tokenizer.pad_token_id
        rows = chunk or [[pad_id]]
        width = max(len(p) for p in rows)
        # right padding: sequence-classification heads read the last non-pad token
        ids = torch.tensor([p + [pad_id] * (width - len(p)) for p in rows], device=self.accelerator.device)
        mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in rows], device=self.accelerator.device)
        self.critic_passes["forward"] += 1
        values = self.critic(input_ids=ids, attention_mask=mask).logits.squeeze(-1).float()
        return values if chunk else values[:0] + 0.0 * values.sum()

    def _values(self, prompts: list[list[int]]) -> torch.Tensor:
        out = []
        with torch.no_grad():
            for idx in self._chunks(prompts, list(range(len(prompts)))):
                out.append(self._critic_forward([prompts[i] for i in idx])[: len(idx)])
        return torch.cat(out) if out else torch.zeros(0, device=self.accelerator.device)

    def _fit_critic(self, prompts: list[list[int]], returns: torch.Tensor, old: torch.Tensor) -> float:
        """``critic_epochs`` passes of the clipped value loss over this generation batch's steps. Each
        chunk's loss is its sum over the chunk's steps on every rank divided by their global count (times
        the world size, which DDP's and FSDP's gradient averaging divides out): the mean over all ranks'
        steps of that chunk, whatever each rank holds."""
        acc = self.accelerator
        losses = []
        self.critic.train()
        for _ in range(self.critic_epochs):
            chunks = self._chunks(prompts, torch.randperm(len(prompts)).tolist())
            counts = torch.tensor([float(len(c)) for c in chunks], device=acc.device)
            if acc.num_processes > 1:
                counts = acc.gather(counts).view(acc.num_processes, -1).sum(0)
            for idx, total in zip(chunks, counts.tolist(), strict=True):
                v = self._critic_forward([prompts[j] for j in idx])
                if idx:
                    g, v_old = returns[idx], old[idx]
                    clipped = v_old + torch.clamp(v - v_old, -self.cliprange_value, self.cliprange_value)
                    loss = 0.5 * torch.max((v - g) ** 2, (clipped - g) ** 2).sum() * acc.num_processes / max(total, 1.0)
                else:
                    loss = v.sum()  # zero, connected to every parameter the forward used
                self.critic_optimizer.zero_grad()
                loss.backward()
                self.critic_passes["backward"] += 1
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
        if mode == "train" and self.critic_epochs > 0:  # every rank, even one without steps (collectives)
            loss = self._fit_critic(prompts, torch.tensor(flat_returns, device=device),
                                    torch.tensor(values, device=device))
            # logged by the main process: the mean over all processes, as for the rewards
            self._metrics[mode]["critic/value_loss"].append(
                self.accelerator.gather(torch.tensor([loss], device=device)).mean().item())
        # the mean over every process's steps (a local mean would log rank 0's half only)
        total = self.accelerator.gather(torch.tensor([sum(values), float(len(values))], device=device)).view(-1, 2).sum(0)
        self._metrics[mode]["critic/value_mean"].append((total[0] / total[1].clamp(min=1.0)).item())
        if self.whiten:
            stats = self.accelerator.gather(torch.tensor([sum(flat_adv), sum(a * a for a in flat_adv),
                                                          float(len(flat_adv))], device=device)).view(-1, 3).sum(0)
            mean = stats[0] / stats[2].clamp(min=1.0)
            std = torch.sqrt(torch.clamp(stats[1] / stats[2].clamp(min=1.0) - mean**2, min=0.0)) + 1e-6
            per_episode = [[(a - mean.item()) / std.item() for a in adv] for adv in per_episode]
        return per_episode


def refuse_unsupported_ppo(config) -> None:
    """PPO under DeepSpeed: the critic would be a second DeepSpeed engine, and accelerate routes
    ``backward`` to one engine only. Refused before any model is loaded: ``PPORecipeConfig`` checks it
    first thing in ``__post_init__`` (``accelerate launch`` with a DeepSpeed config sets
    ACCELERATE_USE_DEEPSPEED=true in every process; ``--deepspeed ds.json`` sets the config's field)."""
    from ..models import launched_with_deepspeed

    if launched_with_deepspeed(config):
        raise ValueError(DEEPSPEED_REFUSED)


def _state_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def save_critic_state(trainer: StepwisePPOTrainer, folder: Path, optimizer: bool) -> None:
    """The critic as a Hugging Face folder (full weights gathered from every rank: sharded under FSDP),
    plus its optimizer's full state under ``optimizer.pt``. Called on every rank (the gathers are
    collectives); the main process writes."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    critic = trainer.accelerator.unwrap_model(trainer.critic)
    weights = get_model_state_dict(critic, options=_state_options(cpu_offload=True))
    optim = get_optimizer_state_dict(critic, trainer.critic_optimizer, options=_state_options(cpu_offload=True)) \
        if optimizer else None
    if trainer.accelerator.is_main_process:
        folder.mkdir(parents=True, exist_ok=True)
        critic.save_pretrained(folder, state_dict=weights)
        if optim is not None:
            torch.save(optim, folder / CRITIC_OPTIMIZER)
    trainer.accelerator.wait_for_everyone()


def load_critic_state(trainer: StepwisePPOTrainer, folder: Path) -> None:
    restore_critic(trainer.accelerator.unwrap_model(trainer.critic), trainer.critic_optimizer, folder)


def _is_sharded(model: torch.nn.Module) -> bool:
    """Whether the model's parameters are DTensors (FSDP2's ``fully_shard``, which accelerate applies)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _model_class(model: torch.nn.Module) -> type:
    """The model's own class: FSDP2 swaps it for a generated subclass ``FSDP<cls>(FSDPModule, cls)``."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(model)
    if issubclass(cls, FSDPModule):
        cls = next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
    return cls


def restore_critic(critic: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Load a critic folder written by :func:`save_critic_state` into ``critic`` and ``optimizer``.

    One process or DDP: every rank reads the full state and loads it. FSDP2 (DTensor parameters): rank 0
    alone reads the files and torch broadcasts them (``broadcast_from_rank0``), each rank keeping its shard.
    Every rank reading them would put a full copy of the critic and of its optimizer state per rank in the
    node's CPU memory (8 x 96 GB for an 8B critic), and with ``fsdp_cpu_ram_efficient_loading``
    (recipes/accelerate/fsdp2.yaml) transformers gives every process but each node's local rank 0
    zero-filled weights (torch 2.13's full-state load scatters a DTensor from rank 0 anyway, so those zeros
    were not loaded; now they are not even read)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    broadcast = _is_sharded(critic) and dist.is_initialized()
    reads = not broadcast or dist.get_rank() == 0
    saved = _model_class(critic).from_pretrained(folder, dtype=torch.float32).state_dict() if reads else {}
    set_model_state_dict(critic, saved, options=_state_options(broadcast_from_rank0=broadcast))
    del saved
    optim = torch.load(folder / CRITIC_OPTIMIZER, weights_only=True, map_location="cpu") if reads else {}
    set_optimizer_state_dict(critic, optimizer, optim, options=_state_options(broadcast_from_rank0=broadcast))


def build_critic(config: PPORecipeConfig):
    """The critic: ``value_model`` (or the policy checkpoint) with a fresh scalar head, loaded in the dtype
    the policy trains in (``models.trainable_dtype``: fp32 unless DeepSpeed, which PPO refuses), so a bf16
    checkpoint is not trained with pure bf16 AdamW."""
    from transformers import AutoModelForSequenceClassification, set_seed

    from ..models import check_checkpoint, launched_with_deepspeed, trainable_dtype

    path = check_checkpoint(config.value_model or config.model_name_or_path)
    dtype = trainable_dtype(config.dtype, launched_with_deepspeed(config))
    # the scalar head is new: initialise it from the run's seed (it was built before Trainer seeds the
    # RNG, so two runs with one seed, or 1 and 2 processes, started from different critics)
    set_seed(config.seed)
    critic = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=dtype if dtype in (None, "auto") else getattr(torch, dtype))
    if critic.config.pad_token_id is None:
        critic.config.pad_token_id = critic.config.eos_token_id
    return critic


def build_trainer(config: PPORecipeConfig) -> StepwisePPOTrainer:
    refuse_unsupported_ppo(config)  # before either model is loaded
    return grpo.build_trainer(config, StepwisePPOTrainer, critic=build_critic(config), critic_config=config)


def save_critic(trainer: StepwisePPOTrainer) -> None:
    save_critic_state(trainer, Path(trainer.args.output_dir) / CRITIC_DIR, optimizer=False)


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
