"""The GRPO recipe's configuration: TRL's ``GRPOConfig`` and ``ModelConfig`` plus the task source, the
environment settings and the step-wise trainer's own options, with their checks; the settings resolved per
device; and the TRL options the step-wise trainer refuses before anything is built.

    config = parse_recipe_args(GRPORecipeConfig, ["--config", "recipes/quickstart/grpo.yaml"])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from trl import GRPOConfig, ModelConfig

from .recipes import CHECKPOINTS
from .task_source import TaskSource


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
                "one process, DDP or FSDP2 (not DeepSpeed or FSDP1)."})
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
        import os

        if (os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and self.beta != 0.0 and not self.use_peft
                and os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "").lower() == "true"):
            # transformers loads the weights on rank 0 only; accelerate broadcasts them into the policy's shards,
            # but TRL 1.16 shards the reference model as loaded (zeros elsewhere): KL against a wrong reference
            raise ValueError("beta > 0 under FSDP with fsdp_cpu_ram_efficient_loading: true gives the reference model "
                             "zero weights on every rank but the first (TRL 1.16); set fsdp_cpu_ram_efficient_loading: "
                             "false in the accelerate config, or beta: 0")
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


GLOBAL_TOKEN_LOSSES = ("dapo", "cispo", "vespo")  # TRL's losses normalised by the generation batch's token count
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


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
