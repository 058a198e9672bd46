r"""Step-wise GRPO for memory episodes, on TRL's GRPOTrainer.

Algorithm (AtomMem's training, DESIGN.md section 1). Each training row is a *task* (a document
stream or a dialogue with questions). TRL's sampler repeats every task G = ``num_generations``
times; each copy runs as one episode of the memory POMDP (``envs``):

  1. all active episodes of this process are stepped together: their prompts (rules and tool
     schemas, questions, scratchpad, retrieved memory views, the current chunk) are rendered with the
     policy's chat template and generated in ONE call through TRL's own generation path
     (``_generate_single_turn``: Hugging Face ``generate``, vLLM colocated, or a vLLM server); the
     completions (tool calls) are applied by the environment;
  2. after the answer phase the episode's return R (terminal task reward, e.g. exact match, plus
     any shaping the environment is configured with) is known;
  3. advantages are group-relative over the G episodes of a task: A = R - mean_group(R), divided by
     the group std only if ``scale_rewards="group"`` (default "none": Dr. GRPO, as AtomMem);
  4. every step of an episode becomes its own (prompt, completion) sample ("multi-conversation"
     rollout) carrying the episode's advantage A, so the terminal advantage reaches every token the
     policy produced in the episode, across all steps. Prompt tokens (observations, tool results,
     memory views) are never trained on: only completion tokens carry loss.

The loss is TRL's: clipped importance ratio with ``epsilon`` / ``epsilon_high`` (clip-high 0.28),
``loss_type="dapo"`` (every policy token of the generation batch weighs the same, which is what a
variable number of steps per episode needs), KL ``beta`` (0 by default). Rollout log-probabilities
from vLLM are kept for TRL's importance-sampling correction. What this subclass overrides is
``_generate_and_score_completions`` (episodes instead of single completions) and, to save compute
only, ``compute_loss``: a micro-batch whose advantages are all 0 (with beta 0) gets its exactly-zero
gradients without a forward/backward (``zero_advantage: skip``; under DDP only when every rank's is).

Launch:
    atommem grpo --config recipes/quickstart/grpo.yaml                     # CPU, SmolLM2-135M
    accelerate launch --config_file recipes/accelerate/zero3.yaml -m atommem_rl.cli grpo \
        --config recipes/qwen3_8b/grpo.yaml                                # 8 GPUs
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from trl import GRPOConfig, GRPOTrainer, ModelConfig
from trl.trainer.utils import RepeatSampler, pad

from envs.core import OPS

from ..rollout import run_rollouts
from ..tasks.schema import Task
from .recipes import CHECKPOINTS, parse_recipe_args
from .packing import step_group_ids
from .rounds import TrainerPolicy
from .task_source import TaskSource, load_train_tasks, resolve_path, task_rows


def episode_return(completions=None, **kwargs) -> list[float]:
    """Named reward for TRL's bookkeeping; the step-wise trainer computes returns in the environment."""
    return [float(r) for r in kwargs.get("episode_return", [0.0] * len(completions or []))]


@dataclass
class GRPORecipeConfig(GRPOConfig, ModelConfig, TaskSource):
    """TRL's ``GRPOConfig`` and ``ModelConfig`` plus the task source and environment settings.

    Defaults changed from TRL to AtomMem's: ``scale_rewards="none"`` (Dr. GRPO), ``epsilon_high=0.28``,
    ``beta=0.0``; W&B offline by default; ``output_dir`` = <checkpoints_dir>/<run_name>/grpo.
    """

    model_name_or_path: str | None = field(
        default="checkpoints/base/smollm2-135m-instruct",
        metadata={"help": "Policy checkpoint (the SFT output, a base model, or a LoRA adapter folder)."})
    run_name: str | None = field(default="atommem", metadata={"help": "Outputs go to <checkpoints_dir>/<run_name>/grpo."})
    checkpoints_dir: str = field(default=CHECKPOINTS, metadata={"help": "Root folder of run outputs."})
    scale_rewards: str = field(default="none", metadata={"help": "none (Dr. GRPO) | group | batch."})
    epsilon_high: float | None = field(default=0.28, metadata={"help": "Upper clip of the ratio (clip-high)."})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient against the reference policy."})
    report_to: None | str | list[str] = field(default="wandb", metadata={"help": "Loggers: wandb, none, ..."})
    rollout_batch_size: int | None = field(
        default=None, metadata={"help": "Episodes stepped at once (None: all episodes of the generation batch)."})
    seeded_sampling: bool = field(default=True, metadata={
        "help": "Hugging Face generate: sample each episode step with its own seed (Gumbel-max, "
                "training/seeded_sampling.py), so rollouts do not depend on the number of processes, the "
                "batch composition or the RNG state (resume). vLLM colocated: each round samples from torch's global "
                "generator seeded from the round's step seeds and restored after it, so rollouts do not depend on "
                "the random numbers the update drew (TRL's row shuffle does, the packed update does not). "
                "False: the backend's own sampling."})
    shared_prefix_generation: bool | None = field(default=None, metadata={
        "help": "Hugging Face generate (one process or DDP): prefill the common prompt prefix of a round's rows "
                "once (inference/shared_prefix.py; in a first round all G episodes of a task read the same "
                "prompt), the same tokens up to float rounding. None (default): on for CPU training, where it was "
                "measured to help (docs/BENCHMARKS.md), off on CUDA, where it has not been measured. False: "
                "generate's left-padded prefill of every row."})
    grouped_attention: bool | None = field(default=None, metadata={
        "help": "A policy on sdpa attention decodes (and scores without gradients) with sdpa_grouped "
                "(inference/grouped_attention.py): the query heads of a key/value head folded together instead "
                "of the key/value cache copied per head every step, the same results. None (default): on for CPU "
                "training, where it was measured to help; off on CUDA, where its larger mask (4x on the Qwen3-8B "
                "scoring passes) costs memory and sdpa's fused kernels do the same without copies. False: sdpa's own."})
    zero_advantage: str = field(default="skip", metadata={
        "help": "What a step sample or micro-batch whose advantages are all 0 costs (every episode of its groups "
                "scored the same; with beta 0 its gradient is exactly 0). "
                "train: TRL's behaviour, every micro-batch runs its forward/backward. "
                "skip (default): an all-zero micro-batch skips its forward/backward and contributes exact zero "
                "gradients (one process or DDP, where every rank's must be all 0; under FSDP/DeepSpeed it runs). "
                "hold: as skip, but the gradients stay unset, so an optimizer step made only of such micro-batches "
                "leaves the weights and Adam's state alone (Adam stepping on zero gradients keeps moving every "
                "weight along its momentum; docs/BENCHMARKS.md, \"Learning signal\"). "
                "drop: train only on samples whose advantage is not 0 (DAPO's dynamic-sampling filter, without "
                "refilling): they are dropped before TRL shuffles the batch and cuts it into micro-batches, then "
                "as skip. drop_hold: drop, then as hold (the learning-signal runs with several tasks per step)."})

    vllm_request_timeout: float = field(default=300.0, metadata={
        "help": "vLLM server mode: seconds any one HTTP request to the server may take (TRL's client sets none, so "
                "a stalled server blocked every rank for good). A generation round's requests are retried "
                "vllm_round_retries times, then the run stops on every rank with one error naming the server and "
                "the step (training/rounds.py); a server failure never becomes episodes scored 0."})
    vllm_round_retries: int = field(default=2, metadata={
        "help": "vLLM server mode: how many times a failed generation round is tried again (whole rounds, on the "
                "main process; the same seeds, so the same tokens) before the run stops."})

    max_tokens_per_microbatch: int = field(default=0, metadata={
        "help": "Packed policy update (training/packing.py): the generation batch's trained step samples are folded "
                "into prefix tries (TRL's TreeRow) of at most this many unique tokens per forward/backward, a sample "
                "in the micro-batch that holds its group (task, step); the loss is TRL's, with the same global "
                "token normalisation. Every rank runs the same number of packed micro-batches (empty ones pad). "
                "The no-gradient passes a step may make (reference log-probabilities for beta > 0, old-policy ones "
                "for vLLM's importance-sampling correction or several updates per generation) are packed too. "
                "0: TRL's padded rows, cut by row counts (the recorded runs). Needs loss_type dapo, cispo or vespo; "
                "one process or DDP (not DeepSpeed or FSDP yet)."})
    fork_credit: int = field(default=0, metadata={
        "help": "Step-level credit from K forked episodes per episode (training/fork_credit.py): each episode's "
                "state at its answer phase is rebuilt by replaying its actions and answered K more times; steps "
                "before the answer phase get the value of the memory they built against the group's (Monte Carlo, "
                "K + 1 answers), answer steps their return against the forks' mean. 0: GRPO's terminal advantage "
                "for every step. Needs scale_rewards none; GRPO only."})
    loss_weighting: str = field(default="token", metadata={
        "help": "token: every trained token of the generation batch weighs the same (TRL's dapo global token "
                "mean; an episode weighs as many tokens as it produced); episode: every episode weighs the same "
                "whatever its number of steps (its tokens share 1/episodes). episode needs beta 0 and loss_type "
                "dapo, cispo or vespo; rows or packing alike."})

    auto_bf16: bool = field(default=False, metadata={
        "help": "Choose bf16 autocast where torch reports native bf16 (CUDA with bf16; a CPU with AVX512-BF16 or "
                "AMX), fp32 elsewhere: sets bf16 (and fp16 false) and prints the choice. False: bf16/fp16 as given, and TRL's "
                "config turns bf16 on when neither is given (fp32 needs bf16: false). Off by default: the "
                "packed bf16 update has not been shown to learn (docs/BENCHMARKS.md, \"Learning signal\")."})

    def __post_init__(self):
        if self.auto_bf16:
            from .packing import apply_auto_bf16

            apply_auto_bf16(self)
        if self.output_dir is None:
            self.output_dir = str(Path(self.checkpoints_dir) / (self.run_name or "atommem") / "grpo")
        TaskSource.__post_init__(self)
        ModelConfig.__post_init__(self)
        super().__post_init__()
        if self.scale_rewards not in ("none", "group", "batch"):
            raise ValueError(f"scale_rewards must be none, group or batch, got {self.scale_rewards!r}")
        if self.max_tokens_per_microbatch is None:
            self.max_tokens_per_microbatch = 0
        if self.max_tokens_per_microbatch < 0 or self.max_tokens_per_microbatch == 1:
            raise ValueError(f"max_tokens_per_microbatch must be 0 (off) or at least 2, got {self.max_tokens_per_microbatch}")
        if self.fork_credit < 0:
            raise ValueError(f"fork_credit must be >= 0, got {self.fork_credit}")
        if self.fork_credit and self.scale_rewards != "none":
            raise ValueError("fork_credit needs scale_rewards none (its advantages are differences of returns and "
                             f"Monte Carlo values, not scaled by a group std), got {self.scale_rewards!r}")
        if self.loss_weighting not in ("token", "episode"):
            raise ValueError(f"loss_weighting must be token or episode, got {self.loss_weighting!r}")
        if not self.vllm_request_timeout > 0 or self.vllm_round_retries < 0:
            raise ValueError("vllm_request_timeout must be above 0 and vllm_round_retries at least 0, got "
                             f"{self.vllm_request_timeout!r} and {self.vllm_round_retries!r}")
        from ..models import model_load_kwargs

        model_load_kwargs(self)  # refuses, naming the field, model-loading settings that cannot run here
        if self.zero_advantage not in ZERO_ADVANTAGE_MODES:
            raise ValueError(f"zero_advantage must be one of {', '.join(ZERO_ADVANTAGE_MODES)}, got {self.zero_advantage!r}")


# zero_advantage mode -> (drop zero-advantage samples, skip all-zero micro-batches, leave their gradients unset)
ZERO_ADVANTAGE_MODES = {"train": (False, False, False), "skip": (False, True, False), "hold": (False, True, True),
                        "drop": (True, True, False), "drop_hold": (True, True, True)}


def zero_advantage_mode(args) -> tuple[bool, bool, bool]:
    """(drop, skip, hold) of the config's ``zero_advantage`` (a config without the field: TRL's behaviour)."""
    return ZERO_ADVANTAGE_MODES[getattr(args, "zero_advantage", "train")]


def device_defaults(args, device: torch.device) -> None:
    """Settings left None resolved for the device the trainer runs on: ``grouped_attention`` and
    ``shared_prefix_generation`` are CPU levers (measured there), off on accelerators."""
    on_cpu = device.type == "cpu"
    for name in ("grouped_attention", "shared_prefix_generation"):
        if getattr(args, name, False) is None:
            setattr(args, name, on_cpu)


def group_advantages(returns: torch.Tensor, group_size: int, scale: str = "none") -> torch.Tensor:
    """Group-relative advantages of episode returns laid out as consecutive groups of ``group_size``.

    none: R - mean_group (Dr. GRPO); group: divided by the group std (+1e-4); batch: by the batch std.
    """
    grouped = returns.view(-1, group_size)
    adv = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True).expand_as(grouped).reshape(-1) if group_size > 1 else torch.zeros_like(adv)
        adv = adv / (std + 1e-4)
    elif scale == "batch":
        adv = adv / (returns.std() + 1e-4)
    # A group whose returns are all equal carries no signal, but its float mean need not equal the
    # values (three returns of 1/3 leave |A| ~ 3e-8, ~3e-4 after the group std): exact zeros, so the
    # group is dropped, skipped and kept out of the token normaliser like any other uninformative one.
    flat = (grouped == grouped[:, :1]).all(dim=1, keepdim=True).expand_as(grouped).reshape(-1)
    return adv.masked_fill(flat, 0.0)


def step_samples(episodes: list[list[tuple]], advantages: list[float | list[float]]) -> list[tuple]:
    """(prompt, completion, logps, A) for every step. An episode's advantage is either one number,
    broadcast to all its steps (GRPO), or one number per step (PPO's GAE)."""
    out = []
    for steps, adv in zip(episodes, advantages, strict=True):
        per_step = adv if isinstance(adv, list) else [adv] * len(steps)
        if len(per_step) != len(steps):
            raise ValueError(f"{len(per_step)} advantages for an episode of {len(steps)} steps")
        out.extend((p, c, lp, a) for (p, c, lp), a in zip(steps, per_step))
    return out


GLOBAL_TOKEN_LOSSES = ("dapo", "cispo", "vespo")  # TRL's losses normalised by the generation batch's token count
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_sampling_ratio(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                              clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """vLLM's sampling distribution differs from the trained policy's (kernels, precision): the rollout
    tokens are reweighted by pi_old / pi_vllm, per token (shape B x T) or per sequence (B x 1, the
    product over its tokens). ``*_truncate`` clamps the ratio to [clip_min, clip_max]; ``*_mask``
    zeroes it outside that range (the sample then carries no loss). None bounds are open. NaN sampling
    log-probabilities (unavailable from vLLM) count as no correction. These are TRL's modes and defaults."""
    if mode not in IS_MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {', '.join(IS_MODES)}, got {mode!r}")
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    lo = -float("inf") if clip_min is None else clip_min
    hi = float("inf") if clip_max is None else clip_max
    if mode.endswith("truncate"):
        return ratio.clamp(min=lo, max=hi)
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


class EpochRepeatSampler(RepeatSampler):
    """TRL's RepeatSampler draws each epoch's permutation from one generator seeded once, so epoch e's
    order depends on the e draws before it; a run resumed in epoch e (Trainer does not replay earlier
    epochs) would get epoch 0's order. Here the generator is reseeded with seed + epoch at the start of
    every pass, the epoch read from the trainer's state (``epoch_of``; restored on resume), so the order
    depends on the epoch only. (accelerate's ``set_epoch`` does not reach a sampler behind its
    skip-batches wrapper on several processes, so the trainer state is the one reliable source.)"""

    def __init__(self, *args, epoch_of, **kwargs):
        super().__init__(*args, **kwargs)
        self.epoch_of = epoch_of

    def __iter__(self):
        self.generator.manual_seed(int(self.seed or 0) + int(self.epoch_of()))
        return super().__iter__()


def refuse_unsupported(config, peft_config=None) -> None:
    """Settings of TRL's GRPOTrainer that the step-wise override does not carry, refused with a clear error
    before anything is built (everything else TRL's loss reads is passed through unchanged)."""
    if config is None:
        return
    errors = []
    if getattr(config, "vllm_importance_sampling_mode", "sequence_mask") not in IS_MODES:
        errors.append(f"vllm_importance_sampling_mode must be one of {', '.join(IS_MODES)}, "
                      f"got {config.vllm_importance_sampling_mode!r}")
    if (getattr(config, "use_vllm", False) and getattr(config, "vllm_mode", None) == "colocate"
            and getattr(config, "vllm_tensor_parallel_size", 1) > 1):
        # TRL's colocated tensor-parallel path slices each group's gathered prompts by equal counts, and
        # ranks hold different numbers of active episodes at a step
        errors.append("vllm_mode colocate with vllm_tensor_parallel_size > 1 is not supported by the step-wise "
                      "trainer (ranks hold different numbers of episodes); use vllm_mode server")
    packing = bool(getattr(config, "max_tokens_per_microbatch", 0))
    episode = getattr(config, "loss_weighting", "token") == "episode"
    loss_type = getattr(config, "loss_type", "dapo")
    if (packing or episode) and loss_type not in GLOBAL_TOKEN_LOSSES:
        # the others normalise per micro-batch (row counts), which packing changes
        errors.append(f"max_tokens_per_microbatch / loss_weighting episode need loss_type in "
                      f"{', '.join(GLOBAL_TOKEN_LOSSES)} (normalised over the whole generation batch), got {loss_type!r}")
    if episode and getattr(config, "beta", 0.0) != 0.0:
        errors.append("loss_weighting episode with beta > 0 is not supported (the KL term would stay a token mean)")
    if packing and (getattr(config, "top_entropy_quantile", 1.0) < 1.0 or getattr(config, "entropy_coef", 0.0)
                    or getattr(config, "use_adaptive_entropy", False)):
        errors.append("max_tokens_per_microbatch with top_entropy_quantile < 1 or an entropy bonus is not supported "
                      "(TRL takes both per micro-batch); set max_tokens_per_microbatch: 0")
    if errors:
        raise ValueError("; ".join(errors))


def refuse_unsupported_packing(trainer) -> None:
    """Packed updates need settings only known once the trainer is built: one process, DDP or FSDP2
    (``packing.sharding_refusal`` says why not DeepSpeed or FSDP1)."""
    from .packing import sharding_refusal

    if not getattr(trainer.args, "max_tokens_per_microbatch", 0):
        return
    error = sharding_refusal(trainer.accelerator.distributed_type, fsdp2=trainer.accelerator.is_fsdp2)
    if error:
        raise ValueError(error)
    if trainer.aux_loss_enabled:
        raise ValueError("max_tokens_per_microbatch does not carry the MoE router auxiliary loss; set it to 0")


class StepwiseGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose generation batch is made of memory episodes (see the module docstring)."""

    def __init__(self, *args, env_config: dict | None = None, rollout_batch_size: int | None = None, **kwargs):
        cfg = kwargs.get("args", args[2] if len(args) > 2 else None)
        if getattr(cfg, "use_vllm", False) and getattr(cfg, "vllm_mode", None) == "colocate":
            from atommem_rl.inference.vllm_cpu import keep_vllm_cpu_weights_loadable

            keep_vllm_cpu_weights_loadable()  # before TRL builds the engine; see its docstring
        refuse_unsupported(cfg, kwargs.get("peft_config"))
        super().__init__(*args, **kwargs)
        device_defaults(self.args, self.accelerator.device)
        client = getattr(getattr(self, "vllm_generation", None), "vllm_client", None)  # server mode, main process
        if client is not None:
            from .rounds import bound_server_calls

            bound_server_calls(client, self.args.vllm_request_timeout)
        if self.args.grouped_attention:  # before any packed update wraps the model's attention as its own
            from atommem_rl.inference.grouped_attention import use_grouped_attention

            use_grouped_attention(self.accelerator.unwrap_model(self.model))
        self.env_config = dict(env_config or {})
        self.rollout_batch_size = rollout_batch_size
        refuse_unsupported_packing(self)
        self._packed = None  # the packed micro-batch being scored (see _get_per_token_logps_and_entropies)
        self._sample_meta: list[tuple] = []  # (episode, group) of each row of the last generation batch

    def _get_train_sampler(self, dataset=None):
        """TRL's RepeatSampler, reseeded per epoch (see :class:`EpochRepeatSampler`)."""
        s = super()._get_train_sampler(dataset)
        if type(s) is not RepeatSampler or not s.shuffle:
            return s
        # state.epoch is e + (steps done in epoch e) / (steps per epoch): its floor is the current epoch
        return EpochRepeatSampler(data_source=s.data_source, mini_repeat_count=s.mini_repeat_count,
                                  batch_size=s.batch_size, repeat_count=s.repeat_count, shuffle=True, seed=s.seed,
                                  epoch_of=lambda: int(self.state.epoch or 0))

    def _run_episodes(self, tasks: list[Task], seed: int) -> tuple[list[dict], list[list[tuple]]]:
        """Run one episode per task (in task order); returns trajectories and per-step token samples."""
        policy = TrainerPolicy(self, seed)
        finished: list[dict] = []
        run_rollouts(tasks, policy, {"tokenizer": self.processing_class, **self.env_config},
                     batch_size=self.rollout_batch_size or len(tasks), seed=seed, record_prompts=False,
                     on_episode=finished.append)
        policy.drain()
        self._prefill = (sum(c.get("prompt_tokens", 0) for c in policy.prefill_stats),
                         sum(c.get("forwarded_prompt_tokens", 0) for c in policy.prefill_stats))
        # records carry the task's key (0..n-1). An attempt that failed on a store outage was
        # restarted under the same key (policy.start reset its steps), and a task skipped after its
        # retries has a record without steps: it scores 0 and gives no samples
        by_key = {r["key"]: r for r in finished}
        recs = [by_key[k] for k in range(len(tasks))]
        self._forks = None
        if getattr(self.args, "fork_credit", 0) and self.model.training:
            self._forks = self._run_forks(tasks, recs, seed)
        # a step that crashed the environment has no trajectory record: it is not a sample
        return recs, [policy.steps.get(k, [])[: len(by_key[k]["steps"])] for k in range(len(tasks))]

    def _run_forks(self, tasks: list[Task], recs: list[dict], seed: int) -> tuple[list, list]:
        """``fork_credit``: K forks of every episode from its answer phase (training/fork_credit.py), generated in
        rounds every rank joins (a rank without forks drains). Returns (V_e or None, fork point or None) per
        local episode."""
        from .fork_credit import fork_plan, fork_point, fork_values

        forks = int(self.args.fork_credit)
        owners, replay = fork_plan(recs, forks, seed)
        # fork sampling seeds apart from the episodes' own (a TrainerPolicy seeds step s of key k with mix(seed + k, s))
        policy = TrainerPolicy(self, seed + 7_919_000_003)
        done = run_rollouts([tasks[k] for k in owners], policy, {"tokenizer": self.processing_class, **self.env_config},
                            batch_size=max(1, self.rollout_batch_size or len(owners)), seed=seed,
                            record_prompts=False, replay=replay)
        policy.drain()
        by_key = {r["key"]: float(r.get("return", 0.0)) for r in done}
        values = fork_values(owners, [by_key.get(i, 0.0) for i in range(len(owners))], len(recs))
        local = torch.tensor([float(len(owners)), float(sum(by_key.values())), float(sum(v is not None for v in values))],
                             device=self.accelerator.device)
        total = self.accelerator.gather(local).view(-1, 3).sum(0).tolist()
        m = self._metrics["train"]
        m["fork/rollouts"].append(total[0])
        m["fork/episodes_forked"].append(total[2])
        if total[0]:
            m["fork/return"].append(total[1] / total[0])
        return values, [fork_point(r.get("steps") or []) if v is not None else None for r, v in zip(recs, values)]

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        device = self.accelerator.device
        mode = "train" if self.model.training else "eval"
        group = self.num_generations if mode == "train" else self.num_generations_eval
        tasks = [Task.from_dict(json.loads(x["task"])) for x in inputs]
        # episode k of this process resets with seed + k: offset by the process's place in the global
        # batch, so an episode's seed depends on its global index, not on how many processes run
        seed = (int(self.args.seed) + 1_000_003 * int(self.state.global_step)
                + self.accelerator.process_index * len(inputs))
        recs, episodes = self._run_episodes(tasks, seed)

        returns = torch.tensor([float(r.get("return", 0.0)) for r in recs], dtype=torch.float32, device=device)
        all_returns = self.accelerator.gather(returns)
        samples = step_samples(episodes, self._advantages(recs, episodes, all_returns, group))
        sample_returns = [float(r.get("return", 0.0)) for r, steps in zip(recs, episodes) for _ in steps]
        # (local episode, group) of each sample: the group (task, step) is what packing shares a prefix over
        meta = list(zip([e for e, steps in enumerate(episodes) for _ in steps], step_group_ids(episodes, group),
                        strict=True))
        # logged per step taken, dropped or not
        n_steps, completion_tokens = len(samples), sum(len(s[1]) for s in samples)
        if mode == "train" and zero_advantage_mode(self.args)[0] and samples:
            keep = [i for i, s in enumerate(samples) if s[3]]
            self._metrics[mode]["samples_kept"].append(len(keep) / len(samples))
            samples, sample_returns = [samples[i] for i in keep], [sample_returns[i] for i in keep]
            meta = [meta[i] for i in keep]
        n_real = len(samples)
        samples = samples + [self._masked_sample()] * (self._local_rows(n_real, mode) - n_real)
        self._sample_meta = meta + [(None, None)] * (len(samples) - n_real)

        pad_id = self._tokenizer.pad_token_id
        prompt_ids = pad([torch.tensor(s[0]) for s in samples], padding_value=pad_id, padding_side="left").to(device)
        prompt_mask = pad([torch.ones(len(s[0]), dtype=torch.long) for s in samples], padding_value=0,
                          padding_side="left").to(device)
        completion_ids = pad([torch.tensor(s[1] or [pad_id]) for s in samples], padding_value=pad_id,
                             padding_side="right").to(device)
        trained = [int(s[3] is not None and len(s[1]) > 0 and not self._masked_as_truncated(s[1])) for s in samples]
        completion_mask = pad([torch.full((max(1, len(s[1])),), m, dtype=torch.long) for s, m in zip(samples, trained)],
                              padding_value=0, padding_side="right").to(device)
        adv = torch.tensor([0.0 if s[3] is None else s[3] for s in samples], dtype=torch.float32, device=device)
        num_items_in_batch = self.accelerator.gather(completion_mask.sum()).sum()
        if getattr(self.args, "loss_weighting", "token") == "episode" and mode == "train":
            adv = adv * self._episode_scale(completion_mask, num_items_in_batch)

        output: dict[str, Any] = {
            "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": adv, "num_items_in_batch": num_items_in_batch,
        }
        self._score_old_and_ref(output, samples, mode)
        self._log_episodes(mode, recs, all_returns, n_steps, completion_tokens)
        from .diagnostics import log_generation_diagnostics  # TRL's own metrics, which TRL's override logged

        log_generation_diagnostics(self, mode, samples[:n_real], output, all_returns, group)
        if self.log_completions:
            real = samples[:n_real]
            self._logs["prompt"].extend(gather_object([self._tokenizer.decode(s[0][-400:]) for s in real]))
            self._logs["completion"].extend(gather_object([self._tokenizer.decode(s[1]) for s in real]))
            for name in self.reward_func_names:  # the episode's return, as TRL logs each reward function's value
                self._logs["rewards"][name].extend(gather_object(sample_returns))
            self._logs["advantages"].extend(gather_object([float(s[3]) for s in real]))
        return output

    def _episode_scale(self, completion_mask: torch.Tensor, num_items_in_batch: torch.Tensor) -> torch.Tensor:
        """``loss_weighting: episode``: per-row factor N / (E x n_e) on the advantages (N trained tokens and E
        episodes with trained tokens over all ranks, n_e the trained tokens of the row's episode). TRL's
        losses of GLOBAL_TOKEN_LOSSES are linear in the advantage for a positive factor (clipping and
        masks read its sign only), so the token-mean loss becomes the mean over episodes of each episode's
        token mean. An episode lives on one rank, so n_e is local."""
        tokens = completion_mask.sum(dim=1).float()
        per_episode: dict[int, float] = {}
        for (e, _), n in zip(self._sample_meta, tokens.tolist(), strict=True):
            if e is not None:
                per_episode[e] = per_episode.get(e, 0.0) + n
        local = torch.tensor([float(sum(1 for n in per_episode.values() if n))], device=tokens.device)
        episodes = self.accelerator.gather(local).sum().clamp(min=1.0)
        n_e = torch.tensor([per_episode.get(e, 0.0) if e is not None else 0.0 for e, _ in self._sample_meta],
                           device=tokens.device)
        scale = num_items_in_batch.float() / (episodes * n_e.clamp(min=1.0))
        return torch.where(n_e > 0, scale, torch.zeros_like(scale))

    # -- packed policy update (max_tokens_per_microbatch > 0): see training/packing.py
    def _prepare_inputs(self, generation_batch):
        """TRL's buffering of one generation batch over ``steps_per_generation`` micro-steps, except that with
        packing each micro-step gets a list of packed micro-batches instead of a slice of rows."""
        if not (getattr(self.args, "max_tokens_per_microbatch", 0) and self.model.training):
            return super()._prepare_inputs(generation_batch)
        spg = self.args.steps_per_generation
        if self._step % (spg * self.num_iterations) == 0 or self._buffered_inputs is None:
            self._buffered_inputs = self._pack_generation_batch(self._generate_and_score_completions(generation_batch))
        return self._buffered_inputs[self._step % spg]

    def _pack_generation_batch(self, output: dict[str, Any]) -> list[dict[str, Any]]:
        """The rows of a generation batch packed under the token budget (padding rows and rows without
        trained tokens left out), the packed micro-batches padded with empty ones to the largest count of
        any rank (and at least steps_per_generation), then dealt in order to the micro-steps: micro-step j
        gets the same number of them on every rank. Each carries the row tensors of its samples for
        TRL's loss (``rows``) and its packed layout (``packed``)."""
        from .packing import microbatch_inputs, pad_microbatches, term_positions

        spg = self.args.steps_per_generation
        pad_id = self._tokenizer.pad_token_id
        lengths = output["completion_mask"].size(1)
        plan = self._plan_trained_rows(output)
        count = max(len(plan), spg)
        if self.accelerator.num_processes > 1:
            count = int(self.accelerator.gather(torch.tensor([count], device=self.accelerator.device)).max())
        plan = pad_microbatches(plan, count)
        device = self.accelerator.device
        per_row = {k: v for k, v in output.items() if torch.is_tensor(v) and v.dim() > 0}
        # TRL's loss gathers per-row metrics: the k-th micro-batch holds the same number of rows on every rank
        # (the largest; extra rows are copies of row 0 with their mask cleared, as the row path pads)
        sizes = torch.tensor([max(len(r.samples), 1) for r in plan], device=device)
        if self.accelerator.num_processes > 1:
            sizes = self.accelerator.gather(sizes).view(self.accelerator.num_processes, -1).max(dim=0).values
        micro = []
        for row, size in zip(plan, sizes.tolist(), strict=True):
            idx = [s["index"] for s in row.samples]
            real = torch.tensor([True] * len(idx) + [False] * (size - len(idx)), device=device)
            idx = idx + [0] * (size - len(idx))
            rows = {k: v[idx] for k, v in per_row.items()}
            rows.update({k: v for k, v in output.items() if k not in per_row})
            rows["completion_mask"] = rows["completion_mask"] * real[:, None]
            rows["advantages"] = torch.where(real, rows["advantages"], torch.zeros_like(rows["advantages"]))
            packed = microbatch_inputs(row, pad_id, device)
            # each loss term's (row in ``rows``, completion position): a sample's terms are consecutive
            packed["term_at"] = (packed["segment_id"], term_positions(packed, len(row.samples)))
            packed["shape"] = (len(idx), lengths)
            micro.append({"rows": rows, "packed": packed})
        per_step = [micro[j * count // spg:(j + 1) * count // spg] for j in range(spg)]
        self._metrics["train"]["packing/forwarded_tokens"].append(float(sum(m["packed"]["forwarded_tokens"]
                                                                            for m in micro)))
        self._metrics["train"]["packing/microbatches"].append(float(count))
        return [{"packed_microbatches": ms, "advantages": torch.cat([m["rows"]["advantages"] for m in ms])}
                for ms in per_step]

    def _plan_trained_rows(self, output: dict[str, Any]) -> list:
        """The rows of a generation batch that carry trained tokens, folded into TRL ``TreeRow``s of at most
        ``max_tokens_per_microbatch`` unique tokens, each sample dict's ``index`` its row in ``output``."""
        from .packing import plan_microbatches, tree_samples

        pick = [i for i, t in enumerate((output["completion_mask"].sum(dim=1) > 0).tolist()) if t]
        samples = []
        for i in pick:
            prompt = output["prompt_ids"][i][output["prompt_mask"][i].bool()].tolist()
            n = int(output["completion_mask"][i].sum())
            samples.append((prompt, output["completion_ids"][i][:n].tolist(), None, 1.0))
        tree = tree_samples(samples, [self._sample_meta[i][1] for i in pick])
        for s, i in zip(tree, pick, strict=True):
            s["index"] = i
        return plan_microbatches(tree, self.args.max_tokens_per_microbatch)

    def _packed_scores(self, output: dict[str, Any], model, adapter_context=None) -> torch.Tensor:
        """Per-token log-probabilities (rows x completion positions; 0 where no token is trained) of the
        generation batch's trained tokens under ``model`` without gradients, from packed forwards under the
        token budget: what TRL's padded-row pass computes for the old-policy (importance-sampling correction)
        and reference (KL) log-probabilities, at the packed update's cost and numerics (the same autocast).
        One process or DDP: no collective runs (the unwrapped model, no gradients), so ranks may run different
        numbers of them. FSDP2: every forward all-gathers the parameters, so every rank runs as many as the
        busiest one (empty micro-batches pad, as for the update); a mismatch would hang."""
        from .packing import is_sharded, microbatch_inputs, packed_logprobs, pad_microbatches, term_positions

        mask = output["completion_mask"]
        logps = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        inner = self.accelerator.unwrap_model(model)
        pad_id = self._tokenizer.pad_token_id
        plan = self._plan_trained_rows(output)
        if self.accelerator.num_processes > 1 and is_sharded(inner):
            count = torch.tensor([len(plan)], device=mask.device)
            plan = pad_microbatches(plan, int(self.accelerator.gather(count).max()))
        with torch.no_grad(), self.accelerator.autocast(), (adapter_context or contextlib.nullcontext()):
            for row in plan:
                packed = microbatch_inputs(row, pad_id, mask.device)
                lp = packed_logprobs(inner, packed, temperature=self.temperature)
                real = packed["sample_index"] >= 0  # an empty micro-batch's phantom term belongs to no row
                at = (packed["sample_index"][real], term_positions(packed, len(row.samples))[real])
                logps.index_put_(at, lp.float()[real])
        return logps

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **kwargs):
        """TRL's, except while a packed micro-batch is scored (``self._packed``): its log-probabilities (and
        entropies) from one forward over the packed row, laid out as TRL's (rows x completion positions)."""
        if self._packed is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **kwargs)
        from .packing import packed_logprobs

        packed = self._packed
        inner = self.accelerator.unwrap_model(model)
        wrapped = model if model is not inner else None
        with self.accelerator.autocast():
            lp, ent = packed_logprobs(inner, packed, temperature=self.temperature, forward_model=wrapped,
                                      with_entropy=True)
        b, t = packed["term_at"]
        # float32 rows, as TRL's: under FSDP2's bf16 mixed precision the fused head returns bf16 values
        logps = torch.zeros(packed["shape"], dtype=torch.float32, device=lp.device).index_put((b, t), lp.float())
        entropies = torch.zeros(packed["shape"], dtype=torch.float32, device=lp.device).index_put(
            (b, t), ent.detach().float()) if compute_entropy else None
        return logps, entropies, None

    def _packed_loss(self, model, inputs) -> torch.Tensor:
        """TRL's loss over each packed micro-batch of this micro-step: all but the last are backpropagated
        here (without gradient synchronisation), the last is returned for the Trainer's backward, which
        synchronises on the accumulation boundary as usual. Under FSDP2 accelerate's ``no_sync`` is FSDP2's own
        ``set_requires_gradient_sync(False)``: the gradients accumulate unsharded and are reduce-scattered once
        per optimizer step, in the last backward (tests/test_fsdp2_packing.py counts one reduce-scatter per
        parameter group); parameters reshard after every backward (FSDP2's default), so each packed forward
        gathers them again, the same number of times on every rank (the counts are padded)."""
        total = None
        parts = inputs["packed_microbatches"]
        for k, part in enumerate(parts):
            self._packed = part["packed"]
            try:
                loss = super().compute_loss(model, part["rows"])
            finally:
                self._packed = None
            if k == len(parts) - 1:
                return loss if total is None else loss + total
            sync_off = self.accelerator.no_sync(model) if self.accelerator.sync_gradients else contextlib.nullcontext()
            with sync_off:
                self.accelerator.backward(loss)
            total = loss.detach() if total is None else total + loss.detach()
        raise RuntimeError("a micro-step without packed micro-batches")

    def _masked_sample(self) -> tuple:
        """A one-token row with no loss: pads a rank's batch to the row count every rank holds."""
        pad_id = self._tokenizer.pad_token_id
        return ([pad_id], [pad_id], [0.0] if self.use_vllm else None, None)

    def _local_rows(self, n_real: int, mode: str) -> int:
        """Rows this rank's generation batch is padded to: the same on every rank, so every forward over it
        (old/ref log-probabilities in chunks of per_device_*_batch_size, then the steps_per_generation
        micro-batches) runs the same number of times on every rank; ZeRO-3 and FSDP gather parameters in
        each forward and would deadlock otherwise. A multiple of steps_per_generation, which TRL cuts the
        batch into (dropping a remainder), and at least 1."""
        n = n_real
        if self.accelerator.num_processes > 1:
            n = int(self.accelerator.gather(torch.tensor([n_real], device=self.accelerator.device)).max())
        spg = self.args.steps_per_generation if mode == "train" else 1
        return max(spg, -(-n // spg) * spg)

    def _masked_as_truncated(self, completion: list[int]) -> bool:
        """``mask_truncated_completions``: a completion that ends in neither EOS nor padding was cut at
        max_completion_length and carries no loss (TRL's rule)."""
        if not self.mask_truncated_completions or not completion:
            return False
        return completion[-1] not in (*self.eos_token_ids, self._tokenizer.pad_token_id)

    def _score_old_and_ref(self, output: dict, samples: list[tuple], mode: str) -> None:
        """Old-policy log-probabilities (when TRL's loss needs them: several updates per generation batch,
        or vLLM's importance-sampling correction), the importance-sampling ratio, and the reference
        log-probabilities for the KL term (beta > 0; with PEFT the adapter-disabled policy, as TRL)."""
        device = self.accelerator.device
        prompt_ids, completion_ids = output["prompt_ids"], output["completion_ids"]
        completion_mask = output["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention = torch.cat([output["prompt_mask"], torch.ones_like(completion_mask)], dim=1)
        keep = completion_ids.size(1)
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        sampling = None
        if self.use_vllm and all(s[2] is not None for s in samples):
            sampling = pad([torch.tensor(s[2] if s[2] else [0.0]) for s in samples], padding_value=0.0,
                           padding_side="right").to(device)
            output["sampling_per_token_logps"] = sampling
        is_correction = self.use_vllm and self.vllm_importance_sampling_correction
        if is_correction and sampling is None:
            raise RuntimeError("vLLM returned no sampling log-probabilities, which the importance-sampling "
                               "correction needs (vllm_importance_sampling_correction: false turns it off)")
        generate_every = self.args.steps_per_generation * self.num_iterations
        # a packed update scores these passes packed too (same numerics as its loss, unique tokens only)
        packed = mode == "train" and bool(getattr(self.args, "max_tokens_per_microbatch", 0)) and self.model.training
        with torch.no_grad():
            if self.args.gradient_accumulation_steps % generate_every != 0 or is_correction:
                output["old_per_token_logps"] = (
                    self._packed_scores(output, self.model) if packed else self._get_per_token_logps_and_entropies(
                        self.model, input_ids, attention, keep, batch_size=batch_size)[0])
            if self.beta != 0.0:
                output["ref_per_token_logps"] = (self._packed_ref_logps(output) if packed else
                                                 self._ref_logps(input_ids, attention, keep, batch_size))
        if is_correction:
            output["importance_sampling_ratio"] = importance_sampling_ratio(
                output["old_per_token_logps"], sampling, completion_mask, self.vllm_importance_sampling_mode,
                self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max)

    def _packed_ref_logps(self, output: dict[str, Any]) -> torch.Tensor:
        """:meth:`_ref_logps` from packed forwards (:meth:`_packed_scores`)."""
        if self.ref_model is not None:
            return self._packed_scores(output, self.ref_model)
        from trl.trainer.utils import use_adapter

        model = self.accelerator.unwrap_model(self.model)
        return self._packed_scores(output, self.model, adapter_context=use_adapter(
            model, adapter_name="ref" if "ref" in model.peft_config else None))

    def _ref_logps(self, input_ids, attention, keep, batch_size):
        if self.ref_model is not None:
            return self._get_per_token_logps_and_entropies(self.ref_model, input_ids, attention, keep,
                                                           batch_size=batch_size)[0]
        # PEFT: TRL keeps no reference copy; the reference is the policy with its adapter disabled (or the
        # initial copy TRL loads as adapter "ref" when an existing adapter is trained further)
        from trl.trainer.utils import use_adapter

        model = self.accelerator.unwrap_model(self.model)
        with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
            return self._get_per_token_logps_and_entropies(self.model, input_ids, attention, keep,
                                                           batch_size=batch_size)[0]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss, except for a micro-batch that cannot move the policy: with beta 0 every loss type
        is linear in the advantages, so all-zero advantages give exactly zero gradients. On a CPU that
        forward/backward is most of a GRPO step (a group whose episodes all scored 0 is common early on);
        ``0 * sum(params)`` gives the same zero gradients (the optimizer still steps, Adam's moments
        decay as they would) without it. With ``zero_advantage: hold`` the gradients stay unset
        instead, and a step made only of such micro-batches leaves the weights and optimizer state alone:
        stepping Adam on zero gradients keeps moving every weight along its momentum, which with sparse
        rewards is most steps (measured in docs/BENCHMARKS.md, "Learning signal")."""
        if self._all_advantages_zero(inputs):
            self._metrics["train"]["skipped_zero_advantage"].append(1.0)
            self._average_skipped_gradients(model)
            if zero_advantage_mode(self.args)[2]:
                # connected to no parameter: its backward leaves every .grad as it was (None after
                # the Trainer's zero_grad), and the optimizer skips parameters without a gradient
                return torch.zeros((), device=self.accelerator.device, requires_grad=True)
            params = [p for p in model.parameters() if p.requires_grad]
            return torch.stack([p.sum() for p in params]).sum() * 0.0
        if self.model.training:
            self._metrics["train"]["skipped_zero_advantage"].append(0.0)
        if "packed_microbatches" in inputs:
            return self._packed_loss(model, inputs)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _average_skipped_gradients(self, model) -> None:
        """A skipped micro-step that closes an accumulation window under DDP: average the accumulated
        gradients over the ranks by hand. DDP averages in the backward of a forward it ran with
        synchronisation on, which is only ever the window's last micro-step; the earlier ones ran under
        ``no_sync``. Skipping that forward would leave every rank stepping its optimizer on its own local
        gradients, and the replicas would drift apart for the rest of the run. Every rank takes this path
        together (the skip is decided collectively), with the same parameters holding gradients (the same
        micro-steps ran everywhere), so the all-reduces match."""
        acc = self.accelerator
        if acc.num_processes < 2 or not acc.sync_gradients:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:  # hold, and nothing earlier in the window had signal: every rank has no gradient
            return
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:  # one all-reduce per dtype (a flat buffer holds one)
            by_dtype.setdefault(g.dtype, []).append(g)
        for _, group in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):  # the same order on every rank
            flat = _flatten_dense_tensors(group)
            torch.distributed.all_reduce(flat)
            flat /= acc.num_processes
            for g, avg in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
                g.copy_(avg)

    def _all_advantages_zero(self, inputs) -> bool:
        """Whether this micro-batch may skip its forward/backward (``zero_advantage`` skip, hold, drop...).

        With several processes the ranks must agree, since DDP all-reduces gradients in the backward
        of a forward it ran: they skip together only when every rank's micro-batch is all zeros (one
        all-reduce of a flag; every rank runs the same number of micro-batches). A backward that did
        not come from a DDP forward fires no reduction, and every rank's gradients are zero anyway.
        DeepSpeed and FSDP gather parameters inside their own forward and reduce inside their own
        backward, so there the micro-batch always runs."""
        from accelerate.utils import DistributedType

        acc = self.accelerator
        if not (zero_advantage_mode(self.args)[1] and self.beta == 0.0 and self.model.training
                and acc.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)):
            return False
        nonzero = torch.any(inputs["advantages"] != 0).float().reshape(1)
        if acc.num_processes > 1:
            nonzero = acc.reduce(nonzero, reduction="sum")
        return nonzero.item() == 0

    def _advantages(self, recs: list[dict], episodes: list[list[tuple]], all_returns: torch.Tensor,
                    group: int) -> list[float | list[float]]:
        """One advantage per local episode: group-relative over all processes' returns (GRPO); with
        ``fork_credit`` one per step (training/fork_credit.py). PPO overrides this with per-step GAE from a critic."""
        if getattr(self, "_forks", None) is not None:
            from .fork_credit import pooled_values, step_advantages

            values, points = self._forks
            returns = [float(r.get("return", 0.0)) for r in recs]
            pooled = torch.tensor(pooled_values(returns, values, int(self.args.fork_credit)), dtype=torch.float32,
                                  device=all_returns.device)
            grouped = self.accelerator.gather(pooled).view(-1, group)
            baseline = grouped.mean(dim=1, keepdim=True).expand_as(grouped).reshape(-1)
            i0 = self.accelerator.process_index * len(recs)
            return step_advantages(returns, values, points, [len(s) for s in episodes],
                                   baseline[i0: i0 + len(recs)].tolist(), int(self.args.fork_credit))
        all_adv = group_advantages(all_returns, group, self.scale_rewards)
        i0 = self.accelerator.process_index * len(recs)
        return all_adv[i0 : i0 + len(recs)].tolist()

    def _log_episodes(self, mode: str, recs: list[dict], all_returns: torch.Tensor, n_steps: int,
                      completion_tokens: int) -> None:
        """Reward, operation frequencies per step (AtomMem's training-dynamics figure), tool errors,
        episode lengths and tokens, averaged over all processes."""
        m = self._metrics[mode]
        m["reward"].append(all_returns.mean().item())
        m["reward_std"].append(all_returns.std().item() if all_returns.numel() > 1 else 0.0)
        local = {
            "em": sum(r.get("em", 0.0) for r in recs), "f1": sum(r.get("f1", 0.0) for r in recs),
            "episode_steps": sum(len(r["steps"]) for r in recs),
            "tool_errors": sum(r.get("tool_errors", 0) for r in recs),
            "crashes": sum(int(r.get("crashed", False)) for r in recs),
            "completion_tokens": float(completion_tokens),
            **{f"op_{op}": sum((r.get("ops") or {}).get(op, 0) for r in recs) for op in OPS},
            "episodes": len(recs), "steps": n_steps,
            # Hugging Face generate's prompt tokens and those it prefilled (shared_prefix_generation; 0, 0 on vLLM)
            "prompt_tokens": float(getattr(self, "_prefill", (0, 0))[0]),
            "prefilled_tokens": float(getattr(self, "_prefill", (0, 0))[1]),
        }
        keys = sorted(local)
        totals = self.accelerator.gather(torch.tensor([float(local[k]) for k in keys], device=self.accelerator.device))
        totals = totals.view(-1, len(keys)).sum(0).tolist()
        agg = dict(zip(keys, totals))
        eps, steps = max(agg["episodes"], 1.0), max(agg["steps"], 1.0)
        m["episode/em"].append(agg["em"] / eps)
        m["episode/f1"].append(agg["f1"] / eps)
        m["episode/steps"].append(agg["episode_steps"] / eps)
        m["episode/crashes"].append(agg["crashes"])
        m["tools/errors_per_step"].append(agg["tool_errors"] / steps)
        m["tokens/completion_per_step"].append(agg["completion_tokens"] / steps)
        for op in OPS:
            m[f"ops/{op}_per_step"].append(agg[f"op_{op}"] / steps)
        if agg["prompt_tokens"]:
            m["rollout/prefilled_per_prompt_token"].append(agg["prefilled_tokens"] / agg["prompt_tokens"])


def build_trainer(config: GRPORecipeConfig, trainer_cls: type = StepwiseGRPOTrainer, **extra) -> StepwiseGRPOTrainer:
    """The policy (optionally LoRA), the tasks as TRL rows, and the step-wise trainer."""
    from ..models import launched_with_deepspeed, load_policy, model_load_kwargs, trainable_dtype

    tasks = load_train_tasks(config)
    dtype = trainable_dtype(config.dtype, launched_with_deepspeed(config))
    model, tokenizer = load_policy(resolve_path(config.model_name_or_path), dtype=dtype, trainable=True,
                                   load_kwargs=model_load_kwargs(config))
    peft_config = None
    if config.use_peft:
        from trl import get_peft_config

        peft_config = get_peft_config(config)
    return trainer_cls(
        model=model, reward_funcs=[episode_return], args=config, train_dataset=task_rows(tasks),
        processing_class=tokenizer, peft_config=peft_config, env_config=config.env_config,
        rollout_batch_size=config.rollout_batch_size, **extra,
    )


def train(config: GRPORecipeConfig, build=build_trainer, phase: str = "grpo", on_trained=None) -> dict:
    """Run the stage; a rerun of the same command resumes from the last checkpoint when
    ``resume_from_checkpoint`` is true. Returns the summary also written to <output_dir>/<phase>_summary.json."""
    from .sft import preflight, resume_label, setup_wandb

    t0 = time.perf_counter()
    resume = preflight(config)  # checkpoints checked before anything is built or written
    Path(config.output_dir).mkdir(parents=True, exist_ok=True)
    setup_wandb(config)
    trainer = build(config)
    from .checkpoint_env import write_env  # its environment, beside the weights
    write_env(config.output_dir, config.env_config, phase)
    from .checkpoints import agree_on_resume  # every rank the main process's choice, now that a group exists

    resume = agree_on_resume(resume, getattr(config, "checkpoint_parts", ()))
    result = trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(config.output_dir)
    if on_trained is not None:
        on_trained(trainer)
    summary = {"output_dir": config.output_dir, "run_name": config.run_name, "global_step": trainer.state.global_step,
               "train_loss": result.training_loss, "resumed_from": resume_label(config, resume),
               "resume_checkpoint": resume,
               "seconds": round(time.perf_counter() - t0, 1)}
    if trainer.accelerator.is_main_process:
        (Path(config.output_dir) / f"{phase}_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def main(argv: list[str] | None = None) -> int:
    config = parse_recipe_args(GRPORecipeConfig, argv)
    print(json.dumps(train(config), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
