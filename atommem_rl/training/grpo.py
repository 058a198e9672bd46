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
    accelerate launch --config_file recipes/accelerate/fsdp2.yaml -m atommem_rl.cli grpo \
        --config recipes/qwen3_8b/grpo.yaml                                # 8 GPUs, packed update under FSDP2
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from trl import GRPOTrainer
from trl.trainer.utils import RepeatSampler, pad

from ..rollout import run_rollouts
from ..tasks.schema import Task
from .advantages import group_advantages, importance_sampling_ratio, step_samples
from .diagnostics import log_episodes, log_generation_diagnostics
# the config and its checks live in grpo_config.py; re-exported here, where recipes and tests import them from
from .grpo_config import (GLOBAL_TOKEN_LOSSES, IS_MODES, ZERO_ADVANTAGE_MODES, GRPORecipeConfig,  # noqa: F401
                          device_defaults, refuse_unsupported, zero_advantage_mode)
from .packed_update import PackedUpdate, refuse_unsupported_packing
from .packing import step_group_ids
from .recipes import parse_recipe_args
from .rounds import TrainerPolicy
from .task_source import load_train_tasks, resolve_path, task_rows
from .zero_advantage import ZeroAdvantageLoss


def episode_return(completions=None, **kwargs) -> list[float]:
    """Named reward for TRL's bookkeeping; the step-wise trainer computes returns in the environment."""
    return [float(r) for r in kwargs.get("episode_return", [0.0] * len(completions or []))]


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


class StepwiseGRPOTrainer(ZeroAdvantageLoss, PackedUpdate, GRPOTrainer):
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
        self._prefill = tuple(sum(c.get(k, 0) for c in policy.prefill_stats)  # diagnostics.log_episode_stats
                              for k in ("prompt_tokens", "forwarded_prompt_tokens", "row_steps", "kept_tokens"))
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
        log_episodes(self, mode, recs, all_returns, n_steps, completion_tokens)
        # TRL's own metrics, which the overridden method logged
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
