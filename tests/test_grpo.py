"""Step-wise GRPO: advantages against a hand computation, the broadcast to step samples, a real
training run on CPU with a tiny random-weight model, and that only policy tokens get gradient."""

from __future__ import annotations

import json

import pytest
import torch

from atommem_rl.training.grpo import GRPORecipeConfig, build_trainer, group_advantages, step_samples, train


def test_group_advantages_by_hand():
    returns = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    # Dr. GRPO: R - mean of the group, no std division
    assert group_advantages(returns, 4, "none").tolist() == [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]
    # group std (unbiased, as torch.std): group 1 std = 0.5, group 2 std = 0.57735
    g = group_advantages(returns, 4, "group").tolist()
    assert g[0] == pytest.approx(0.75 / (0.5 + 1e-4)) and g[4] == pytest.approx(0.5 / (0.5773503 + 1e-4))
    # a group where every episode scored the same carries no signal
    assert group_advantages(torch.tensor([0.3, 0.3]), 2, "group").tolist() == [0.0, 0.0]


def test_groups_that_scored_the_same_get_exactly_zero_advantages():
    """Returns are means of per-question scores (1/3, 2/3...): a group whose returns are all equal must
    get exact zeros whatever float rounding its mean leaves (it is then dropped, skipped and kept out of
    the token normaliser), under every scaling; an informative group beside it keeps its values."""
    third = torch.tensor([1.0, 1.0, 1.0]).div(3.0)
    returns = torch.cat([third, torch.tensor([0.1, 0.7, 0.2])]).float()
    for scale in ("none", "group", "batch"):
        adv = group_advantages(returns, 3, scale)
        assert adv[:3].tolist() == [0.0, 0.0, 0.0] and all(a != 0 for a in adv[3:].tolist()), scale
    # the float32 mean of these values is not exactly them (what the exact zeros guard against)
    odd = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1], dtype=torch.float32)
    assert group_advantages(odd, 7, "group").tolist() == [0.0] * 7


def test_cpu_levers_default_to_the_device():
    """grouped_attention and shared_prefix_generation: None means on for CPU training, off on CUDA;
    an explicit value is kept."""
    from types import SimpleNamespace

    from atommem_rl.training.grpo import device_defaults

    for device, want in (("cpu", True), ("cuda", False)):
        args = SimpleNamespace(grouped_attention=None, shared_prefix_generation=None)
        device_defaults(args, torch.device(device))
        assert args.grouped_attention is want and args.shared_prefix_generation is want
    args = SimpleNamespace(grouped_attention=True, shared_prefix_generation=False)
    device_defaults(args, torch.device("cuda"))
    assert args.grouped_attention is True and args.shared_prefix_generation is False


def test_zero_advantage_modes_and_the_keys_they_replaced(tmp_path):
    from atommem_rl.training.grpo import ZERO_ADVANTAGE_MODES, zero_advantage_mode
    from atommem_rl.training.recipes import RecipeError, parse_recipe_args

    assert zero_advantage_mode(GRPORecipeConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")) \
        == (False, True, False)  # skip by default
    assert set(ZERO_ADVANTAGE_MODES) == {"train", "skip", "hold", "drop", "drop_hold"}
    with pytest.raises(ValueError, match="zero_advantage must be one of"):
        GRPORecipeConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", zero_advantage="sometimes")
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text("hold_on_zero_advantage: true\n")
    with pytest.raises(RecipeError, match="'hold_on_zero_advantage' was replaced by zero_advantage"):
        parse_recipe_args(GRPORecipeConfig, ["--config", str(recipe)])
    with pytest.raises(RecipeError, match="'skip_zero_advantage' was replaced by zero_advantage"):
        parse_recipe_args(GRPORecipeConfig, ["--skip_zero_advantage", "false", "--output_dir", str(tmp_path),
                                             "--use_cpu", "true", "--report_to", "none"])


def test_episode_advantage_reaches_every_step():
    episodes = [[([1], [2], None), ([3], [4], None), ([5], [6], None)], [([7], [8], None)]]
    samples = step_samples(episodes, [0.5, -0.5])
    assert [(s[0][0], s[3]) for s in samples] == [(1, 0.5), (3, 0.5), (5, 0.5), (7, -0.5)]
    with pytest.raises(ValueError):
        step_samples(episodes, [0.5])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from atommem_rl.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def small_config(tiny, out, cls=GRPORecipeConfig, **kw) -> GRPORecipeConfig:
    base = dict(model_name_or_path=str(tiny), output_dir=str(out), use_cpu=True, bf16=False,
                per_device_train_batch_size=4, num_generations=2, max_completion_length=16, max_steps=1,
                logging_steps=1, save_steps=1, report_to="none", gradient_checkpointing=False,
                learning_rate=1e-3, synth_tasks=2, synth_docs=1, synth_questions=1, synth_confounders=0,
                env_config={"chunk_tokens": 64, "max_prompt_tokens": 2048, "max_answer_steps": 1}, seed=0)
    base.update(kw)
    return cls(**base)


@pytest.fixture
def scripted_returns(monkeypatch):
    """Episode returns from the episode's own tokens (tests/multirank/scripted_returns.py): a group's
    episodes score differently, so GRPO's advantages are not zero (the tiny model's real returns all are)."""
    from atommem_rl.training.grpo import StepwiseGRPOTrainer

    from .multirank.scripted_returns import install

    monkeypatch.setattr(StepwiseGRPOTrainer, "_run_episodes", StepwiseGRPOTrainer._run_episodes)  # undone after
    install()


@pytest.mark.slow
def test_grpo_trains_and_writes_a_loadable_checkpoint(tiny, tmp_path, scripted_returns):
    from safetensors.torch import load_file

    summary = train(small_config(tiny, tmp_path / "grpo"))
    assert summary["global_step"] == 1
    ckpt = tmp_path / "grpo" / "checkpoint-1"
    history = json.loads((ckpt / "trainer_state.json").read_text())["log_history"][0]
    assert history["skipped_zero_advantage"] == 0.0 and history["reward_std"] > 0
    w0, w1 = load_file(tiny / "model.safetensors"), load_file(ckpt / "model.safetensors")
    assert max((w1[k] - w0[k]).abs().max().item() for k in w1 if k in w0) > 1e-4  # lr 1e-3: Adam's first step
    assert (ckpt / "model.safetensors").exists() and (ckpt / "trainer_state.json").exists()
    history = json.loads((ckpt / "trainer_state.json").read_text())["log_history"][0]
    for key in ("reward", "episode/steps", "ops/create_per_step", "tools/errors_per_step"):
        assert key in history
    # seeded sampling is greedy over noised scores, so the rollouts decoded with rows leaving as they end
    assert history["rollout/decoded_per_kept_token"] >= 1.0
    assert history["episode/steps"] == 2.0  # one chunk step and one answer step per episode
    from atommem_rl.models import load_policy

    load_policy(ckpt)


@pytest.mark.slow
def test_only_completion_tokens_receive_gradient(tiny, tmp_path):
    trainer = build_trainer(small_config(tiny, tmp_path / "grad", synth_tasks=1))
    rows = [trainer.train_dataset[0]] * 2  # one task, group of 2
    trainer.model.train()
    batch = trainer._generate_and_score_completions(rows)
    n = batch["completion_ids"].size(0)
    assert n >= 4  # two episodes x (chunk step + answer step)
    batch["advantages"] = torch.linspace(-1.0, 1.0, n)  # non-zero signal on every sample
    # pretend the last sample's completion is padding from its second token on
    batch["completion_mask"][-1, 1:] = 0

    trainer.current_gradient_accumulation_steps = 1  # set by the training loop in a real run
    captured = {}
    # the final norm's output at position t feeds only the LM head's prediction of token t + 1, so its
    # gradient says exactly which positions' predictions are trained on (TRL's fused LM head projects
    # only positions whose label is not -100)
    norm = trainer.model.model.norm
    hook = norm.register_forward_hook(lambda m, i, out: captured.__setitem__("h", out) or out.retain_grad())
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    hook.remove()
    grad = captured["h"].grad.abs().sum(-1)  # (samples, prompt + completion)
    P = batch["prompt_ids"].size(1)
    trained = torch.zeros_like(grad, dtype=torch.bool)
    trained[:, P - 1 : -1] = batch["completion_mask"].bool()  # position t predicts token t + 1
    assert torch.all(grad[~trained] == 0)  # prompt, observation, tool-result and padding tokens: none
    assert torch.all(grad[trained] > 0)  # every policy token: some


@pytest.mark.slow
def test_zero_advantage_batch_skips_the_forward_with_the_same_gradients(tiny, tmp_path):
    """A micro-batch whose advantages are all 0 skips TRL's forward/backward; the gradients it gets
    instead (exact zeros on every trainable parameter) are the ones TRL's loss gives, so the optimizer
    step is unchanged. Non-zero advantages still take TRL's path."""
    trainer = build_trainer(small_config(tiny, tmp_path / "skip", synth_tasks=1))
    trainer.model.train()
    batch = trainer._generate_and_score_completions([trainer.train_dataset[0]] * 2)
    batch["advantages"] = torch.zeros(batch["completion_ids"].size(0))
    trainer.current_gradient_accumulation_steps = 1

    def grads(skip: bool) -> list[torch.Tensor]:
        trainer.args.zero_advantage = "skip" if skip else "train"
        trainer.model.zero_grad(set_to_none=True)
        trainer.compute_loss(trainer.model, batch).backward()
        return [p.grad for p in trainer.model.parameters() if p.requires_grad]

    real, skipped = grads(False), grads(True)
    assert trainer._metrics["train"]["skipped_zero_advantage"] == [0.0, 1.0]
    assert all(g is not None and torch.all(g == 0) for g in real)  # TRL's loss: exactly zero gradient
    assert all(g is not None and torch.all(g == 0) for g in skipped)  # the same, without the forward
    batch["advantages"][0] = 1.0
    assert any(torch.any(g != 0) for g in grads(True))  # a signal is never skipped
    assert trainer._metrics["train"]["skipped_zero_advantage"][-1] == 0.0


def test_hold_on_zero_advantage_leaves_weights_and_optimizer_alone(tiny, tmp_path):
    """zero_advantage hold: after an informative step, an all-zero-advantage step leaves every
    weight as it was (no gradient, so AdamW passes over it); TRL's zero gradients instead let Adam's
    momentum move the weights again."""
    trainer = build_trainer(small_config(tiny, tmp_path / "hold", synth_tasks=1, zero_advantage="hold"))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = trainer._generate_and_score_completions([trainer.train_dataset[0]] * 2)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)

    def step(advantage: float) -> list[torch.Tensor]:
        batch["advantages"] = torch.full((batch["completion_ids"].size(0),), advantage)
        opt.zero_grad(set_to_none=True)
        trainer.compute_loss(trainer.model, batch).backward()
        opt.step()
        return [p.detach().clone() for p in params]

    before = step(1.0)  # a signal: the weights move and Adam has momentum
    after = step(0.0)
    assert all(p.grad is None for p in params)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    trainer.args.zero_advantage = "skip"  # zero gradients: Adam keeps moving the weights
    assert any(not torch.equal(a, b) for a, b in zip(after, step(0.0)))


def test_drop_zero_advantage_trains_only_on_informative_groups(tiny, tmp_path, monkeypatch):
    """zero_advantage drop: of two groups, the one whose episodes all scored the same gives no sample;
    the other's samples are all there, with their advantages, counted alone in the loss's token
    normaliser, and the logged per-step metrics still cover every step taken. (The tiny model's
    episodes all score 0, so the advantages are scripted, per episode.)"""
    from atommem_rl.training.grpo import StepwiseGRPOTrainer

    scripted = [0.5, -0.5, 0.0, 0.0]  # task 0's group is informative, task 1's is not
    monkeypatch.setattr(StepwiseGRPOTrainer, "_advantages", lambda self, recs, *a: scripted[: len(recs)])
    trainer = build_trainer(small_config(tiny, tmp_path / "drop", synth_tasks=2, zero_advantage="drop",
                                         steps_per_generation=2, gradient_accumulation_steps=2))
    trainer.model.train()
    rows = [trainer.train_dataset[0]] * 2 + [trainer.train_dataset[1]] * 2
    batch = trainer._generate_and_score_completions(rows)
    m = trainer._metrics["train"]
    steps = m["episode/steps"][-1] * 4  # every episode's steps, logged whether dropped or not
    kept = batch["completion_mask"].sum(dim=1) > 0
    # task 0's two episodes, every step of each, padded to a multiple of steps_per_generation
    assert kept.sum().item() == m["samples_kept"][-1] * steps
    assert set(batch["advantages"][kept].tolist()) == {0.5, -0.5}
    assert batch["completion_ids"].size(0) % 2 == 0 and torch.all(batch["advantages"][~kept] == 0)
    assert batch["num_items_in_batch"].item() == batch["completion_mask"].sum().item()

    scripted[:2] = [0.0, 0.0]  # no group informative: one masked row, which the zero-advantage skip takes
    batch = trainer._generate_and_score_completions(rows)
    assert m["samples_kept"][-1] == 0.0 and batch["completion_mask"].sum().item() == 0
    trainer.current_gradient_accumulation_steps = 2
    trainer.compute_loss(trainer.model, {k: v[:1] if torch.is_tensor(v) and v.dim() else v for k, v in batch.items()})
    assert m["skipped_zero_advantage"][-1] == 1.0


def test_gae_by_hand():
    from atommem_rl.training.ppo import gae

    # three steps, terminal reward 1 on the last, a format penalty of 0.1 on the first
    adv, ret = gae([-0.1, 0.0, 1.0], [0.2, 0.4, 0.5], gamma=1.0, lam=0.5)
    # deltas: -0.1 + 0.4 - 0.2 = 0.1; 0 + 0.5 - 0.4 = 0.1; 1.0 - 0.5 = 0.5
    # A2 = 0.5; A1 = 0.1 + 0.5 * 0.5 = 0.35; A0 = 0.1 + 0.5 * 0.35 = 0.275
    assert adv == pytest.approx([0.275, 0.35, 0.5])
    assert ret == pytest.approx([0.475, 0.75, 1.0])
    # lambda = 1, gamma = 1: advantages are the Monte-Carlo return minus the value
    adv, _ = gae([0.0, 0.0, 1.0], [0.1, 0.2, 0.3], gamma=1.0, lam=1.0)
    assert adv == pytest.approx([0.9, 0.8, 0.7])


@pytest.mark.slow
def test_ppo_trains_policy_and_critic(tiny, tmp_path):
    from atommem_rl.training.ppo import PPORecipeConfig, train as ppo_train

    summary = ppo_train(small_config(tiny, tmp_path / "ppo", cls=PPORecipeConfig))
    assert summary["global_step"] == 1
    history = json.loads((tmp_path / "ppo" / "checkpoint-1" / "trainer_state.json").read_text())["log_history"][0]
    assert "critic/value_loss" in history and "critic/value_mean" in history
    assert (tmp_path / "ppo" / "critic" / "config.json").exists()


def test_model_loading_fields_are_honoured_or_refused(tiny, tmp_path):
    """Every model-loading field a recipe accepts reaches the policy's from_pretrained (attn_implementation,
    model_init_kwargs; before, both were parsed and silently ignored) or is refused before any work, naming
    the field: 4-bit loading without bitsandbytes (a QLoRA recipe used to train plain LoRA), a dtype in
    model_init_kwargs."""
    import importlib.util

    from atommem_rl.training.sft import SFTRecipeConfig

    trainer = build_trainer(small_config(tiny, tmp_path / "eager", attn_implementation="eager"))
    assert trainer.accelerator.unwrap_model(trainer.model).config._attn_implementation == "eager"
    trainer = build_trainer(small_config(tiny, tmp_path / "init", model_init_kwargs={"attn_implementation": "eager"},
                                         grouped_attention=False))
    assert trainer.accelerator.unwrap_model(trainer.model).config._attn_implementation == "eager"
    if importlib.util.find_spec("bitsandbytes") is None:
        with pytest.raises(ValueError, match="load_in_4bit: quantized loading needs bitsandbytes"):
            small_config(tiny, tmp_path / "q", load_in_4bit=True, use_peft=True)
        with pytest.raises(ValueError, match="load_in_8bit: quantized loading needs bitsandbytes"):
            SFTRecipeConfig(model_name_or_path=str(tiny), output_dir=str(tmp_path / "s"), use_cpu=True,
                            report_to="none", load_in_8bit=True, use_peft=True)
    with pytest.raises(ValueError, match="model_init_kwargs: set the weights' dtype with the recipe's dtype key"):
        small_config(tiny, tmp_path / "d", model_init_kwargs={"dtype": "bfloat16"})


def test_fsdp_reference_model_with_rank0_loading_is_refused(tiny, tmp_path, monkeypatch):
    """Under FSDP with fsdp_cpu_ram_efficient_loading, TRL 1.16 shards the reference model with zeros on every
    rank but the first (measured: reference log-probabilities off by up to 1.22 nats on 2 FSDP2 CPU ranks), so
    beta > 0 without PEFT is refused before any work; beta 0 or the setting off is accepted."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    with pytest.raises(ValueError, match="fsdp_cpu_ram_efficient_loading"):
        small_config(tiny, tmp_path / "a", beta=0.04)
    small_config(tiny, tmp_path / "b", beta=0.0)
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
    small_config(tiny, tmp_path / "c", beta=0.04)

