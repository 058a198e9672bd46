"""Supervised fine-tuning (SFT) of the memory policy on step-wise demonstrations.

Algorithm. Every step of a demonstration episode is one example: the step's observation (system
rules + the prompt with question(s), scratchpad, retrieved memories, last results and the chunk) as
the prompt, and the demonstrator's action, an assistant message with Qwen3 ``<tool_call>`` blocks, as
the target, rendered with the tool schemas the environment offered. The loss is the token-level
cross-entropy on assistant tokens only (TRL ``SFTTrainer`` with ``assistant_only_loss=True``; for
Qwen3-family templates TRL swaps in ``qwen3_training.jinja``, whose ``{% generation %}`` markers give
the assistant mask, and which writes an empty think block in every assistant turn); prompt and
tool-result tokens are labelled -100. Demonstrations come from (a) a JSONL file of
``{"messages", "tools"}`` rows (``demonstrations: FILE``), or (b) episodes of the oracle policy, or of
a teacher model behind an OpenAI-compatible endpoint with rejection sampling by terminal reward
(``demo_policy``), on a tasks file or freshly generated synthetic tasks. Optional LoRA through PEFT
(``use_peft: true``); ``merge_lora: true`` also writes the merged full model (``<output_dir>/merged``,
loadable by vLLM; the same as ``scripts/merge_lora.py``).

Outputs: ``checkpoints/<run_name>/sft/`` (``output_dir``): ``checkpoint-N/`` every ``save_steps``
(weights, optimizer, scheduler, RNG state, data position), the final model in the folder itself,
``demonstrations.jsonl`` and ``sft_summary.json``. ``resume_from_checkpoint: true`` (or a path)
continues from the last checkpoint: the same data order, RNG state and optimizer.
W&B logs offline unless ``WANDB_MODE``/``WANDB_API_KEY`` say otherwise (``report_to: none`` turns it off).

Launch::

    atommem sft --config recipes/quickstart/sft.yaml [--key value ...]
    accelerate launch --config_file recipes/accelerate/zero3.yaml -m atommem_rl.training.sft \\
        --config recipes/qwen3_8b/sft.yaml
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from trl import ModelConfig, SFTConfig

from .recipes import CHECKPOINTS, parse_recipe_args
from .task_source import TaskSource, load_train_tasks, parse_mapping, resolve_path

DEMO_POLICIES = ("oracle", "model")


@dataclass
class SFTRecipeConfig(SFTConfig, ModelConfig, TaskSource):
    """TRL's ``SFTConfig`` (training) and ``ModelConfig`` (model, LoRA) plus where demonstrations come
    from (a file, or rollouts on the tasks of ``TaskSource``).

    Defaults changed from TRL: ``assistant_only_loss=True``, ``report_to="wandb"`` (offline by
    default), ``model_name_or_path`` = the quickstart base model, ``output_dir`` derived from ``run_name``.
    """

    # -- model / run
    model_name_or_path: str | None = field(
        default="checkpoints/base/smollm2-135m-instruct",
        metadata={"help": "Model folder or hub id (the quickstart base: scripts/prepare_base_model.py)."})
    run_name: str | None = field(
        default="atommem", metadata={"help": "Run name: outputs go to <checkpoints_dir>/<run_name>/sft; W&B run name."})
    checkpoints_dir: str = field(default=CHECKPOINTS, metadata={"help": "Root folder of run outputs."})
    max_length: int | None = field(default=8192, metadata={
        "help": "Longest example in tokens (prompt + action); a step's prompt is up to the env's max_prompt_tokens."})
    assistant_only_loss: bool = field(default=True, metadata={"help": "Loss on assistant tokens only."})
    report_to: None | str | list[str] = field(default="wandb", metadata={"help": "Loggers: wandb, none, ..."})
    merge_lora: bool = field(default=False, metadata={"help": "With use_peft, also write <output_dir>/merged."})
    # -- demonstrations
    demonstrations: str | None = field(
        default=None, metadata={"help": "JSONL of {messages, tools} rows; when unset they are generated."})
    demo_policy: str = field(default="oracle", metadata={
        "help": "Demonstrator when generating: oracle, or model (a teacher, e.g. an OpenAI-compatible endpoint)."})
    demo_policy_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Keyword arguments (mapping or JSON) for the demonstration policy."})
    demo_samples: int = field(default=1, metadata={"help": "Episodes tried per task (rejection sampling)."})
    demo_min_reward: float | None = field(
        default=None, metadata={"help": "Keep an episode only if its terminal score reaches this (None: keep all)."})
    rollout_batch_size: int = field(default=8, metadata={"help": "Episodes run at once when generating."})
    auto_bf16: bool = field(default=False, metadata={
        "help": "Choose bf16 autocast where torch reports native bf16 (CUDA with bf16; a CPU with AVX512-BF16 or "
                "AMX), fp32 elsewhere: sets bf16 (and fp16 false) and prints the choice. False: bf16/fp16 as given, and TRL's "
                "config turns bf16 on when neither is given (fp32 needs bf16: false)."})

    def __post_init__(self):
        if self.auto_bf16:
            from .packing import apply_auto_bf16

            apply_auto_bf16(self)
        if self.output_dir is None:
            self.output_dir = str(Path(self.checkpoints_dir) / (self.run_name or "atommem") / "sft")
        if self.run_name is None:
            self.run_name = Path(self.output_dir).parent.name
        if isinstance(self.demo_policy_kwargs, str):
            self.demo_policy_kwargs = parse_mapping("demo_policy_kwargs", self.demo_policy_kwargs)
        if self.demo_policy_kwargs is not None and not isinstance(self.demo_policy_kwargs, dict):
            raise ValueError("demo_policy_kwargs must be a mapping")
        TaskSource.__post_init__(self)
        if self.demo_policy not in DEMO_POLICIES:
            raise ValueError(f"demo_policy must be one of {DEMO_POLICIES}, got {self.demo_policy!r}")
        if self.demo_samples < 1:
            raise ValueError("demo_samples must be >= 1")
        if self.merge_lora and not self.use_peft:
            raise ValueError("merge_lora needs use_peft: true")
        ModelConfig.__post_init__(self)  # not reached through SFTConfig's chain
        super().__post_init__()
        from atommem_rl.models import model_load_kwargs

        model_load_kwargs(self)  # refuses, naming the field, model-loading settings that cannot run here




def _wandb_logged_in() -> bool:
    """`wandb login` stores the key in ~/.netrc."""
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def setup_wandb(config: SFTRecipeConfig) -> None:
    """W&B offline unless the user configured it; files under the run's folder."""
    if "wandb" not in (config.report_to or []):
        return
    if "WANDB_MODE" not in os.environ and "WANDB_API_KEY" not in os.environ and not _wandb_logged_in():
        os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_PROJECT", "atommem-rl")
    os.environ.setdefault("WANDB_DIR", str(Path(config.output_dir).parent))
    Path(os.environ["WANDB_DIR"]).mkdir(parents=True, exist_ok=True)


def demonstration_rows(config: SFTRecipeConfig, reuse: bool = False) -> tuple[list[dict], dict]:
    """The training rows: read from ``demonstrations`` or generated by rollouts (saved next to the run).

    ``reuse`` reads the rows an earlier attempt of this run generated (resume, non-main processes).
    """
    from . import demonstrations as demos

    if config.demonstrations:
        path = resolve_path(config.demonstrations)
        return demos.read_rows(path), {"source": str(path)}
    saved = Path(config.output_dir) / "demonstrations.jsonl"
    if reuse and saved.exists():
        return demos.read_rows(saved), {"source": str(saved), "reused": True}
    tasks = load_train_tasks(config)
    env_config = {"tokenizer": resolve_path(config.model_name_or_path), **(config.env_config or {})}
    rows, stats = demos.generate(tasks, config.demo_policy, config.demo_policy_kwargs, env_config,
                                 samples=config.demo_samples, min_reward=config.demo_min_reward,
                                 seed=config.seed, batch_size=config.rollout_batch_size)
    if not rows:
        raise ValueError(f"no demonstrations kept ({stats}); lower demo_min_reward or raise demo_samples")
    out = Path(config.output_dir) / "demonstrations.jsonl"
    demos.write_rows(rows, out)
    return rows, {"source": str(out), "policy": config.demo_policy, **stats}


def build_trainer(config: SFTRecipeConfig, rows: list[dict] | None = None):
    """An ``SFTTrainer`` on the demonstrations (no training yet): model, tokenizer, dataset, LoRA."""
    from trl import SFTTrainer, get_peft_config

    from atommem_rl.models import launched_with_deepspeed, load_policy, model_load_kwargs, trainable_dtype

    from .demonstrations import to_dataset

    if rows is None:
        rows, _ = demonstration_rows(config)
    dtype = trainable_dtype(config.dtype, launched_with_deepspeed(config))
    model, tokenizer = load_policy(resolve_path(config.model_name_or_path), dtype=dtype,
                                   load_kwargs=model_load_kwargs(config))
    trainer = SFTTrainer(model=model, args=config, train_dataset=to_dataset(rows), processing_class=tokenizer,
                         peft_config=get_peft_config(config))
    # SFTTrainer silently drops examples whose assistant tokens all fall beyond max_length.
    kept = len(trainer.train_dataset)
    if kept == 0:
        raise ValueError(f"all {len(rows)} demonstrations are longer than max_length={config.max_length} "
                         "tokens before their first assistant token; raise max_length")
    if kept < len(rows):
        print(f"atommem sft: warning: {len(rows) - kept} of {len(rows)} demonstrations exceed "
              f"max_length={config.max_length} and were dropped", file=sys.stderr)
    return trainer


def _is_hub_id(name: str) -> bool:
    """``org/model`` that is not a local path (those are left to ``from_pretrained``)."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~", "checkpoints/")) and not Path(name).exists()


def preflight(config) -> str | None:
    """Check every checkpoint the stage will read before any work starts (nothing is created yet):
    the policy (``model_name_or_path``), PPO's ``value_model``, and the checkpoint to resume from,
    which is returned (None: start fresh). Shared by SFT, GRPO and PPO (atommem_rl/training/checkpoints.py)."""
    from .checkpoints import check_model, resolve_resume

    for key in ("model_name_or_path", "value_model"):
        name = getattr(config, key, None)
        if name and not _is_hub_id(str(name)):
            try:
                check_model(resolve_path(str(name)))
            except FileNotFoundError as exc:
                raise type(exc)(f"{key}: {exc}") from None
    return resolve_resume(config.resume_from_checkpoint, config.output_dir, getattr(config, "checkpoint_parts", ()))


def resume_label(config, resume: str | None) -> str | None:
    """``"last"`` when the recipe asked for the newest checkpoint and one was found, else the path or None."""
    auto = str(config.resume_from_checkpoint).lower() in ("true", "auto", "last", "yes")
    return ("last" if auto else resume) if resume else None


def train(config: SFTRecipeConfig) -> dict:
    """Run SFT; returns the summary also written to ``<output_dir>/sft_summary.json``."""
    from accelerate import PartialState

    t0 = time.perf_counter()
    # a rerun of the same command with resume_from_checkpoint: true continues from the newest intact checkpoint
    resume = preflight(config)
    Path(config.output_dir).mkdir(parents=True, exist_ok=True)
    setup_wandb(config)
    state = PartialState()
    # The main process generates the demonstrations once; the other ranks (and a resumed run, for the
    # same data order) read the saved file.
    with state.main_process_first():
        rows, data_info = demonstration_rows(config, reuse=bool(resume) or not state.is_main_process)
    trainer = build_trainer(config, rows)
    from .checkpoint_env import write_env  # its environment, beside the weights
    write_env(config.output_dir, config.env_config, "sft")
    from .checkpoints import agree_on_resume  # every rank the main process's choice, now that a group exists

    resume = agree_on_resume(resume, getattr(config, "checkpoint_parts", ()))
    result = trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(config.output_dir)
    summary = {"output_dir": config.output_dir, "run_name": config.run_name, "examples": len(rows),
               "data": data_info, "global_step": trainer.state.global_step,
               "train_loss": result.training_loss, "resumed_from": resume_label(config, resume),
               "resume_checkpoint": resume,
               "seconds": round(time.perf_counter() - t0, 1)}
    if config.use_peft and config.merge_lora and trainer.accelerator.is_main_process:
        from atommem_rl.models import merge_lora

        summary["merged"] = str(merge_lora(config.output_dir, Path(config.output_dir) / "merged"))
    if trainer.accelerator.is_main_process:
        (Path(config.output_dir) / "sft_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def main(argv: list[str] | None = None) -> int:
    from accelerate import PartialState

    config = parse_recipe_args(SFTRecipeConfig, argv)
    summary = train(config)
    if PartialState().is_main_process:
        print(json.dumps(summary, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
