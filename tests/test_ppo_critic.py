"""PPO's critic (training/ppo.py, issue 17 defects 3 and 7): it is stepped under gradient accumulation
(3a), DeepSpeed is refused before any model loads (3b), a resume under FSDP2 with rank-0-only loading
restores every rank's shard (3c), its passes are cut under a token budget with equal chunk counts on every
rank (3e), and it trains in fp32 from a bf16 checkpoint (7). A tiny random-weight model throughout."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest
import torch

from .test_grpo import scripted_returns, small_config  # noqa: F401  (scripted_returns is a fixture)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from atommem_rl.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- 3a: the critic's optimizer steps although the Trainer's accumulation holds sync_gradients False
def test_critic_steps_under_gradient_accumulation(tiny, tmp_path, scripted_returns):  # noqa: F811
    """The critic is fitted on the first micro-step of a generation batch, where with
    gradient_accumulation_steps 2 accelerate's optimizer wrapper skips ``step`` and ``zero_grad``: one
    optimizer step must still move the critic's weights (its trunk and its new head), and the policy's."""
    from atommem_rl.training.ppo import PPORecipeConfig, build_trainer

    config = small_config(tiny, tmp_path / "ppo", cls=PPORecipeConfig, gradient_accumulation_steps=2,
                          per_device_train_batch_size=1, synth_tasks=1, critic_epochs=1, save_strategy="no")
    trainer = build_trainer(config)
    critic, policy = (trainer.accelerator.unwrap_model(m) for m in (trainer.critic, trainer.model))
    critic_before, policy_before = _snapshot(critic), _snapshot(policy)
    trainer.train()
    assert trainer.state.global_step == 1
    assert trainer.critic_passes["backward"] >= 1
    assert "critic/value_loss" in trainer.state.log_history[0]
    critic_after, policy_after = _snapshot(critic), _snapshot(policy)
    moved = [k for k in critic_before if not torch.equal(critic_before[k], critic_after[k])]
    assert "score.weight" in moved and any(k != "score.weight" for k in moved), moved
    assert any(not torch.equal(policy_before[k], policy_after[k]) for k in policy_before)


# -- 3b: DeepSpeed refused before either model is loaded
def test_deepspeed_is_refused_before_any_model_loads(tmp_path, monkeypatch, capsys):
    """``accelerate launch`` with a DeepSpeed config sets ACCELERATE_USE_DEEPSPEED=true in every process: the
    refusal must come first (here before the missing model path is even looked at), in one line, with
    nothing written."""
    from atommem_rl.cli import main

    from .test_recipe_errors import common

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    missing, out = tmp_path / "no-such-model", tmp_path / "run" / "ppo"
    code = main(["ppo", *common(missing, out)])
    err = capsys.readouterr().err
    assert code == 2 and "does not run under DeepSpeed" in err and "fsdp2.yaml" in err, err
    assert "not found" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_deepspeed_config_field_is_refused(tiny, tmp_path, monkeypatch):
    """``--deepspeed ds.json`` (TrainingArguments' field, which sets DeepSpeed up in its own __post_init__)."""
    from atommem_rl.training import ppo

    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    with pytest.raises(ValueError, match="does not run under DeepSpeed"):
        small_config(tiny, tmp_path / "ppo", cls=ppo.PPORecipeConfig, deepspeed=str(tmp_path / "ds.json"))
    # and by the builder, for a config whose environment changed after it was made
    config = small_config(tiny, tmp_path / "ppo", cls=ppo.PPORecipeConfig)
    monkeypatch.setattr(ppo, "build_critic", lambda config: pytest.fail("critic loaded before the refusal"))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="does not run under DeepSpeed"):
        ppo.build_trainer(config)


# -- 7: the critic trains in fp32 (as the policy does) from a bf16 checkpoint
def test_critic_loads_a_bf16_checkpoint_in_fp32(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from atommem_rl.training.ppo import PPORecipeConfig, build_critic

    path = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16).save_pretrained(path)
    for cfg in (dict(model_name_or_path=str(path)), dict(model_name_or_path=str(tiny), value_model=str(path))):
        config = small_config(tiny, tmp_path / "ppo", cls=PPORecipeConfig, dtype="bfloat16", **cfg)
        critic = build_critic(config)
        assert {p.dtype for p in critic.parameters()} == {torch.float32}


# -- 3e: critic passes in chunks under a token budget, the same count on every rank
class _Ranks:
    """The accelerator of one of several simulated ranks: ``gather`` is an all-gather of the chunk counts
    that every rank's own (unpadded) call computed."""

    def __init__(self, counts: list[int]):
        self.counts, self.num_processes, self.device = counts, len(counts), torch.device("cpu")

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self.counts)


def _chunks(prompts, order, batch, budget, accelerator):
    from atommem_rl.training.ppo import StepwisePPOTrainer

    owner = SimpleNamespace(critic_batch_size=batch, critic_max_tokens=budget, accelerator=accelerator)
    return StepwisePPOTrainer._chunks(owner, prompts, order)


def test_critic_chunks_respect_the_token_budget_and_match_across_ranks():
    rng = random.Random(0)
    for trial in range(200):
        batch, budget = rng.randint(1, 6), rng.randint(16, 400)
        # each rank holds a different number of step prompts of different lengths, some above the budget
        ranks = [[[1] * rng.choice([rng.randint(1, 120), rng.randint(1, 500)]) for _ in range(rng.randint(0, 12))]
                 for _ in range(rng.randint(1, 3))]
        orders = [rng.sample(range(len(p)), len(p)) for p in ranks]
        alone = [_chunks(p, o, batch, budget, _Ranks([0])) for p, o in zip(ranks, orders)]
        padded = [_chunks(p, o, batch, budget, _Ranks([len(a) for a in alone])) for p, o in zip(ranks, orders)]
        assert len({len(c) for c in padded}) == 1, (trial, [len(c) for c in padded])  # equal on every rank
        for prompts, order, chunks, own in zip(ranks, orders, padded, alone):
            assert chunks[: len(own)] == own and all(c == [] for c in chunks[len(own):])
            assert [i for c in chunks for i in c] == order  # every step once, in the order given
            for c in own:
                assert 1 <= len(c) <= batch
                width = max(len(prompts[i]) for i in c)
                # padded tokens within the budget; a longer prompt goes alone
                assert width * len(c) <= budget or len(c) == 1, (trial, c, width, budget)
    # by hand: budget 100, widths 60 | 30 30 30 | 150 (alone) | 10
    prompts = [[1] * n for n in (60, 30, 30, 30, 150, 10)]
    assert _chunks(prompts, [0, 1, 2, 3, 4, 5], 8, 100, _Ranks([0])) == [[0], [1, 2, 3], [4], [5]]
    assert _chunks(prompts, [1, 2, 3, 5], 2, 100, _Ranks([2, 5])) == [[1, 2], [3, 5], [], [], []]


# -- 3c: the critic's checkpoint round trip: one process (as DDP: every rank reads), then FSDP2
def _trained_critic(tiny, lr: float = 1e-2):
    from transformers import AutoModelForSequenceClassification

    critic = AutoModelForSequenceClassification.from_pretrained(tiny, num_labels=1, dtype=torch.float32)
    optimizer = torch.optim.AdamW(critic.parameters(), lr=lr)
    critic(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()
    optimizer.step()
    return critic, optimizer


def _save(critic, optimizer, folder):
    """The trainer's own save path (save_critic_state), one process."""
    from atommem_rl.training.ppo import save_critic_state

    owner = SimpleNamespace(critic=critic, critic_optimizer=optimizer, accelerator=SimpleNamespace(
        unwrap_model=lambda m: m, is_main_process=True, wait_for_everyone=lambda: None))
    save_critic_state(owner, folder, optimizer=True)


def test_one_process_resume_restores_the_critic(tiny, tmp_path):
    from atommem_rl.training.ppo import restore_critic

    torch.manual_seed(0)
    critic, optimizer = _trained_critic(tiny)
    _save(critic, optimizer, tmp_path / "critic")
    torch.manual_seed(1)
    fresh, fresh_opt = _trained_critic(tiny, lr=1e-3)
    assert not torch.equal(fresh.score.weight, critic.score.weight)
    restore_critic(fresh, fresh_opt, tmp_path / "critic")
    want, got = critic.state_dict(), fresh.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    for p, q in zip(critic.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], fresh_opt.state[q]["exp_avg_sq"])
    assert fresh_opt.param_groups[0]["lr"] == 1e-2


# -- 3c: resume under FSDP2 with fsdp_cpu_ram_efficient_loading (recipes/accelerate/fsdp2.yaml)
def _fsdp2_resume_rank(rank: int, port: int, src: str, folder: str) -> None:
    """One of 2 gloo ranks: a critic loaded as under accelerate's FSDP2 config with cpu_ram_efficient_loading
    (transformers gives rank 1 zero-filled weights), sharded with FSDP2's fully_shard on CPU, then restored
    from ``folder``. Rank 0 alone may read the checkpoint's files; rank 0 checks the gathered weights and
    optimizer state against them."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="true")
    from pathlib import Path

    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForSequenceClassification, PreTrainedModel

    from atommem_rl.training.ppo import CRITIC_OPTIMIZER, restore_critic

    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        critic = AutoModelForSequenceClassification.from_pretrained(src, num_labels=1, dtype=torch.float32)
        if rank == 1:  # the condition under test: this rank's from_pretrained reads nothing
            assert all(not p.any() for p in critic.parameters())
        mesh = init_device_mesh("cpu", (2,))
        for layer in critic.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(critic, mesh=mesh)
        optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-3)
        reads, load, from_pretrained = [], torch.load, PreTrainedModel.from_pretrained.__func__
        # (torch's own broadcast of Python objects unpickles with torch.load from bytes: not counted)
        torch.load = lambda f, *a, **k: (isinstance(f, (str, os.PathLike)) and reads.append("optimizer"),
                                         load(f, *a, **k))[1]
        PreTrainedModel.from_pretrained = classmethod(lambda cls, *a, **k: (reads.append("weights"),
                                                                             from_pretrained(cls, *a, **k))[1])
        try:
            restore_critic(critic, optimizer, Path(folder))
        finally:
            torch.load, PreTrainedModel.from_pretrained = load, classmethod(from_pretrained)
        # one full copy of the critic and its optimizer per node, not per rank (an 8B critic: 32 GB + 64 GB)
        assert reads == (["weights", "optimizer"] if rank == 0 else []), (rank, reads)
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0
        weights = get_model_state_dict(critic, options=full)
        optim = get_optimizer_state_dict(critic, optimizer, options=full)
        if rank == 0:
            saved = load_file(os.path.join(folder, "model.safetensors"))
            assert set(saved) <= set(weights)
            bad = [k for k in saved if not torch.equal(saved[k].float(), weights[k])]
            assert not bad, f"restored weights differ from the checkpoint: {bad[:5]}"
            want = torch.load(os.path.join(folder, CRITIC_OPTIMIZER), weights_only=True)
            assert set(optim["state"]) == set(want["state"]) and want["state"]
            for k, s in want["state"].items():
                assert torch.equal(optim["state"][k]["exp_avg"], s["exp_avg"]), k
                assert torch.equal(optim["state"][k]["exp_avg_sq"], s["exp_avg_sq"]), k
    finally:
        dist.destroy_process_group()


def test_fsdp2_resume_reads_on_rank0_and_restores_every_shard(tiny, tmp_path):
    """Under FSDP2 with cpu_ram_efficient_loading, ranks other than 0 get zero-filled weights from
    from_pretrained. torch 2.13's full-state load already takes a DTensor's values from rank 0
    (``distribute_tensor``'s src_data_rank=0), so the restored shards were right before too (the weight
    check guards that); what ``restore_critic`` changed is that only rank 0 reads the files, which the
    read count checks (it failed when every rank read them)."""
    from .conftest import free_port

    torch.manual_seed(0)
    folder = tmp_path / "checkpoint-1" / "critic"
    _save(*_trained_critic(tiny), folder)
    torch.multiprocessing.spawn(_fsdp2_resume_rank, args=(free_port(), str(tiny), str(folder)), nprocs=2)
