"""TRL GRPO options that the step-wise override of ``_generate_and_score_completions`` carries itself
(issue 17, defects 5 and 6): an open importance-sampling bound, ``mask_truncated_completions``, PEFT with
beta > 0, advantages logged apart from returns, and the GPU extra's vLLM pin inside TRL's supported range.

The trainer tests replace only the rollout by fixed, hand-built episodes (token ids and returns chosen
here), so every expected value below is written out by hand; the rest of the path is the product's."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from atommem_rl.training.grpo import StepwiseGRPOTrainer, build_trainer, importance_sampling_ratio

from .conftest import REPO
from .test_grpo import small_config, tiny  # noqa: F401 - the tiny random-weight model fixture

E = math.e


# -- 1. importance-sampling correction with clip_max=None ---------------------------------------------
def test_importance_sampling_open_upper_bound_by_hand():
    """clip_max None: no upper limit in any mode (TRL's own default is 3.0; every ratio that should pass
    here is above it, so a None read as a default cap, or a crash on None, fails). clip_min still applies."""
    old = torch.tensor([[0.0, -1.0, -2.0], [-2.0, -1.0, 0.0]])
    vllm = torch.tensor([[-3.0, -1.0, -1.0], [0.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # per token: old - vllm = [3, 0, -1] and [-2, 0, (untrained)]; per sequence: 2 and -2
    tokens = torch.tensor([[E**3, 1.0, E**-1], [E**-2, 1.0, 1.0]])
    torch.testing.assert_close(importance_sampling_ratio(old, vllm, mask, "token_truncate", None, None), tokens)
    torch.testing.assert_close(importance_sampling_ratio(old, vllm, mask, "token_mask", None, None), tokens)
    torch.testing.assert_close(importance_sampling_ratio(old, vllm, mask, "token_truncate", 0.5, None),
                               torch.tensor([[E**3, 1.0, 0.5], [0.5, 1.0, 1.0]]))  # raised to 0.5, never capped
    torch.testing.assert_close(importance_sampling_ratio(old, vllm, mask, "token_mask", 0.5, None),
                               torch.tensor([[E**3, 1.0, 0.0], [0.0, 1.0, 1.0]]))  # below 0.5: no loss
    torch.testing.assert_close(importance_sampling_ratio(old, vllm, mask, "sequence_truncate", 0.2, None),
                               torch.tensor([[E**2], [0.2]]))
    torch.testing.assert_close(importance_sampling_ratio(old, vllm, mask, "sequence_mask", 0.2, None),
                               torch.tensor([[E**2], [0.0]]))
    torch.testing.assert_close(importance_sampling_ratio(old, vllm, mask, "sequence_mask", None, None),
                               torch.tensor([[E**2], [E**-2]]))


# -- fixed episodes in place of the rollout -------------------------------------------------------------
def fixed_episodes(monkeypatch, episodes: list[list[tuple[list[int], list[int]]]], returns: list[float] | None):
    """``_run_episodes`` returns ``episodes`` (per episode of the generation batch, its steps as (prompt ids,
    completion ids)) with ``returns`` (None: leave the record without one, for scripted_returns.install)."""

    def _run_episodes(self, tasks, seed):
        assert len(tasks) == len(episodes)
        recs = [{"key": k, "steps": [{} for _ in steps]} for k, steps in enumerate(episodes)]
        if returns is not None:
            for rec, r in zip(recs, returns, strict=True):
                rec["return"] = r
        return recs, [[(list(p), list(c), None) for p, c in steps] for steps in episodes]

    monkeypatch.setattr(StepwiseGRPOTrainer, "_run_episodes", _run_episodes)


def one_group(trainer) -> list[dict]:
    return [trainer.train_dataset[0]] * trainer.num_generations


# -- 2. mask_truncated_completions ----------------------------------------------------------------------
def test_truncated_completions_are_masked_from_the_loss(tiny, tmp_path, monkeypatch):  # noqa: F811
    """A completion cut at max_completion_length (16 here) without an end token carries no loss with
    mask_truncated_completions, TRL's rule; one that ends in EOS (also the pad token here) keeps its
    tokens; the loss normaliser counts only the tokens that stay. Off: every token is trained."""
    trainer = build_trainer(small_config(tiny, tmp_path / "trunc", synth_tasks=1, mask_truncated_completions=True))
    eos = trainer._tokenizer.eos_token_id
    assert trainer.args.max_completion_length == 16 and eos in trainer.eos_token_ids
    prompt = [1, 40, 41]
    fixed_episodes(monkeypatch, [[(prompt, [100, 101, eos]), (prompt + [7], [102] * 16)],
                                 [(prompt, [103] * 16), (prompt + [8], [104, eos])]], [1.0, 0.0])
    trainer.model.train()
    batch = trainer._generate_and_score_completions(one_group(trainer))
    assert batch["completion_mask"].sum(dim=1).tolist() == [3, 0, 0, 2]
    assert batch["num_items_in_batch"].item() == 5
    assert batch["advantages"].tolist() == [0.5, 0.5, -0.5, -0.5]  # the masked rows still carry theirs

    trainer.mask_truncated_completions = False
    batch = trainer._generate_and_score_completions(one_group(trainer))
    assert batch["completion_mask"].sum(dim=1).tolist() == [3, 16, 16, 2]
    assert batch["num_items_in_batch"].item() == 37


# -- 3. PEFT with beta > 0 -----------------------------------------------------------------------------
def test_peft_reference_is_the_adapter_disabled_policy(tiny, tmp_path, monkeypatch):  # noqa: F811
    """LoRA and beta > 0: TRL keeps no reference model, and the reference log-probabilities are the
    policy's with its adapter disabled: equal to the base model's, and (the adapter's weights perturbed)
    not the adapted policy's. The loss then takes its KL term without a KeyError, and it is positive."""
    from transformers import AutoModelForCausalLM

    # no LoRA dropout: the policy's log-probabilities in train mode are deterministic
    trainer = build_trainer(small_config(tiny, tmp_path / "peft", synth_tasks=1, use_peft=True, beta=0.1,
                                         lora_r=4, lora_alpha=8, lora_dropout=0.0))
    assert trainer.ref_model is None and hasattr(trainer.model, "peft_config")
    torch.manual_seed(0)
    with torch.no_grad():
        lora_b = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
        assert lora_b
        for p in lora_b:
            p.normal_(0.0, 0.5)
    prompt = [1, 40, 41, 42]
    fixed_episodes(monkeypatch, [[(prompt, [100, 101, 102, 2])], [(prompt, [103, 104, 2])]], [1.0, 0.0])
    trainer.model.train()
    batch = trainer._generate_and_score_completions(one_group(trainer))
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop in a real run
    loss = trainer.compute_loss(trainer.model, batch)  # reads ref_per_token_logps (KeyError without them)
    loss.backward()
    assert torch.isfinite(loss)
    assert trainer._metrics["train"]["kl"][-1] > 1e-3  # against the adapted policy itself it is 0

    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], torch.ones_like(batch["completion_mask"])], dim=1)
    keep = batch["completion_ids"].size(1)
    mask = batch["completion_mask"].bool()
    assert batch["prompt_mask"].all()  # equal prompts: no left padding, positions as in a plain forward
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():  # the base model's log-probabilities of the completion tokens, by hand
        logits = base(input_ids=input_ids, attention_mask=attention).logits[:, -keep - 1:-1] / trainer.temperature
        base_lp = logits.log_softmax(-1).gather(-1, batch["completion_ids"][..., None])[..., 0]
        policy_lp = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention, keep)[0]
    ref = batch["ref_per_token_logps"]
    torch.testing.assert_close(ref[mask], base_lp[mask], rtol=1e-4, atol=1e-4)
    assert (ref[mask] - policy_lp[mask]).abs().max().item() > 1e-2


# -- 4. advantages logged apart from returns ------------------------------------------------------------
def test_returns_and_advantages_are_logged_under_their_own_keys(tiny, tmp_path, monkeypatch):  # noqa: F811
    """One generation batch with scripted returns (tests/multirank/scripted_returns.py: a function of the
    episode's own tokens): the logged reward metric is the mean return, the completions log holds each
    step's episode return under the reward function's name and its advantage (return - group mean)
    under ``advantages``, as TRL's table shows them."""
    from trl.trainer import grpo_trainer

    from .multirank.scripted_returns import install, scripted_return

    trainer = build_trainer(small_config(tiny, tmp_path / "logs", synth_tasks=1, log_completions=True))
    prompt = [1, 40, 41]
    episodes = [[(prompt, [100, 101, 2]), (prompt + [7], [102, 2])], [(prompt, [103, 104, 105, 2])]]
    fixed_episodes(monkeypatch, episodes, None)
    install()  # wraps the fixed episodes; the monkeypatch restores the trainer's own method afterwards
    r = [scripted_return([(p, c, None) for p, c in steps]) for steps in episodes]
    assert r[0] != r[1]  # a group with a signal
    mean = (r[0] + r[1]) / 2
    trainer.model.train()
    trainer._generate_and_score_completions(one_group(trainer))

    shown = {}
    monkeypatch.setattr(grpo_trainer, "print_prompt_completions_sample",
                        lambda prompts, completions, rewards, advantages, *a, **k: shown.update(
                            rewards={n: list(v) for n, v in rewards.items()}, advantages=list(advantages)))
    monkeypatch.setattr(grpo_trainer, "is_rich_available", lambda: True)
    trainer.log({})
    logged = trainer.state.log_history[-1]
    assert logged["reward"] == pytest.approx(mean)
    assert shown["rewards"] == {"episode_return": pytest.approx([r[0], r[0], r[1]])}
    assert shown["advantages"] == pytest.approx([r[0] - mean, r[0] - mean, r[1] - mean])


def test_trl_generation_diagnostics_are_logged_under_trls_names(tiny, tmp_path, monkeypatch):  # noqa: F811
    """The step-wise override logs what TRL's own _generate_and_score_completions logs (completion lengths,
    the share cut at max_completion_length, num_tokens, frac_reward_zero_std), by hand on fixed episodes;
    and the vLLM mismatch diagnostics plus the share of masked sequences from an importance-sampling ratio."""
    from types import SimpleNamespace

    from atommem_rl.training.diagnostics import log_generation_diagnostics

    trainer = build_trainer(small_config(tiny, tmp_path / "diag", synth_tasks=1))
    eos = trainer._tokenizer.eos_token_id
    prompt = [1, 40, 41]
    # episode 0: 3 + 16 (cut) completion tokens, episode 1: 2 + 4; prompts 3 + 4 + 3 + 4 tokens
    fixed_episodes(monkeypatch, [[(prompt, [100, 101, eos]), (prompt + [7], [102] * 16)],
                                 [(prompt, [103, eos]), (prompt + [8], [104, 105, 106, eos])]], [0.5, 0.5])
    trainer.model.train()
    trainer._generate_and_score_completions(one_group(trainer))
    m = trainer._metrics["train"]
    assert m["completions/mean_length"][-1] == pytest.approx((3 + 16 + 2 + 4) / 4)
    assert (m["completions/min_length"][-1], m["completions/max_length"][-1]) == (2.0, 16.0)
    assert m["completions/clipped_ratio"][-1] == pytest.approx(0.25)
    assert m["completions/max_terminated_length"][-1] == 4.0
    assert m["num_tokens"] == [float(3 + 4 + 3 + 4 + 25)]
    assert m["frac_reward_zero_std"][-1] == 1.0  # the one group scored 0.5 and 0.5

    # the importance-sampling diagnostics, by hand: 2 trained rows, sequence_mask zeroed the second
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    old = torch.tensor([[-1.0, -1.0, 0.0], [-2.0, -1.0, -1.0], [0.0, 0.0, 0.0]])
    sampled = torch.tensor([[-1.5, -1.0, 0.0], [-1.0, float("nan"), -1.0], [0.0, 0.0, 0.0]])
    ratio = torch.tensor([[1.6], [0.0], [1.0]])
    from collections import defaultdict

    fake = SimpleNamespace(_metrics={"eval": defaultdict(list)}, eos_token_ids=[eos],
                           _tokenizer=trainer._tokenizer, accelerator=trainer.accelerator, state=trainer.state)
    log_generation_diagnostics(fake, "eval", [], {"completion_mask": mask, "old_per_token_logps": old,
                                                 "sampling_per_token_logps": sampled, "importance_sampling_ratio": ratio},
                               torch.tensor([0.0, 1.0]), 2)
    d = fake._metrics["eval"]
    assert d["sampling/sampling_logp_difference/mean"] == [pytest.approx((0.5 + 0 + 1 + 0) / 4)]
    assert d["sampling/sampling_logp_difference/max"] == [pytest.approx(1.0)]
    assert d["sampling/importance_sampling_ratio/min"] == [0.0] and d["sampling/importance_sampling_ratio/max"] == [pytest.approx(1.6)]
    assert d["sampling/masked_sequence_ratio"] == [0.5] and d["frac_reward_zero_std"] == [0.0]


# -- 5. defect 5: the GPU extra's vLLM pin -------------------------------------------------------------
def test_gpu_extra_pins_vllm_inside_trls_supported_range(monkeypatch):
    """pyproject.toml's ``gpu`` extra pins one vLLM version, inside the range the installed TRL declares
    for its vLLM integration (its ``vllm`` extra), and TRL's own import-time check accepts it quietly."""
    import importlib.metadata
    import tomllib

    import trl.import_utils as trl_imports
    from packaging.requirements import Requirement
    from packaging.version import Version

    gpu = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    pins = [req for req in map(Requirement, gpu) if req.name == "vllm"]
    assert len(pins) == 1
    exact = [s.version for s in pins[0].specifier if s.operator == "=="]
    assert len(exact) == 1, f"the gpu extra should pin one vLLM version, got {pins[0]}"
    pinned = Version(exact[0])

    declared = [req for req in map(Requirement, importlib.metadata.requires("trl"))
                if req.name == "vllm" and req.marker is not None and req.marker.evaluate({"extra": "vllm"})]
    assert len(declared) == 1 and str(declared[0].specifier)
    assert declared[0].specifier.contains(pinned), f"vllm=={pinned} is outside TRL's {declared[0].specifier}"

    def installed(version):
        monkeypatch.setattr(trl_imports, "_is_package_available",
                            lambda name, return_version=False: (True, version) if return_version else True)

    installed(str(pinned))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert trl_imports.is_vllm_available()
    upper = max(Version(s.version) for s in declared[0].specifier if s.operator in ("<", "<="))
    beyond = f"{upper.major}.{upper.minor + 1}.0"  # control: TRL's check does see the version handed to it
    assert not declared[0].specifier.contains(beyond)
    installed(beyond)
    with pytest.warns(UserWarning, match="supports vLLM"):
        trl_imports.is_vllm_available()
