"""Forked episodes (``run_rollouts(replay=...)``): an episode restarted from its seed with a recorded action
prefix continues from the exact state the original reached, and the step-level credit GRPO computes from such
forks (``fork_credit``, training/fork_credit.py)."""

from __future__ import annotations

import json

import pytest

from atommem_rl.policies.base import Policy
from atommem_rl.rollout import make_policy, run_rollouts
from atommem_rl.tasks.synth import generate_tasks

# the full setting: every tool, 2 questions, 2 confounders, several chunk steps
ENV = dict(tokenizer="smollm2", chunk_tokens=128, max_prompt_tokens=3072, embedder="hashing")


class Lookup(Policy):
    """Answers a prompt with what the original episode answered to the very same prompt: a forked episode whose
    state differed in anything the prompt shows (memory views, scratchpad, results, chunk) raises KeyError."""

    name = "lookup"

    def __init__(self, table: dict[str, str]):
        self.table = table
        self.asked = 0

    def act(self, batch):
        self.asked += len(batch)
        return [self.table[json.dumps(obs)] for _, obs, _ in batch]


def _memory(rec):
    return sorted((m.get("text"), m.get("role")) for m in rec["memory"])


def test_replay_forks_an_episode_at_its_exact_state():
    tasks = generate_tasks(4, seed=4321, docs=4, questions=2, confounders=2)
    orig = sorted(run_rollouts(tasks, make_policy("oracle", supersede="update"), ENV, batch_size=4, seed=5),
                  key=lambda r: r["key"])
    assert all(len(r["steps"]) >= 3 and not r["crashed"] for r in orig)
    table = {json.dumps(s["prompt"]): s["completion"] for r in orig for s in r["steps"]}
    forks, replay = [], {}
    for r, task in zip(orig, tasks, strict=True):
        answer_at = next(i for i, s in enumerate(r["steps"]) if s["phase"] == "answer")
        for t in sorted({1, answer_at}):  # mid-stream and at the answer phase
            replay[len(forks)] = {"seed": 5 + r["key"], "actions": [s["completion"] for s in r["steps"][:t]]}
            forks.append((r, t))
    policy = Lookup(table)
    out = run_rollouts([tasks[r["key"]] for r, _ in forks], policy, ENV, batch_size=3, seed=999, replay=replay)
    assert len(out) == len(forks) and not any(rec["crashed"] for rec in out), [rec.get("traceback") for rec in out]
    for rec in out:
        r, t = forks[rec["key"]]
        assert [s["completion"] for s in rec["steps"]] == [s["completion"] for s in r["steps"]]
        assert [s["prompt"] for s in rec["steps"]] == [s["prompt"] for s in r["steps"]]
        assert [bool(s.get("replayed")) for s in rec["steps"]] == [i < t for i in range(len(r["steps"]))]
        assert rec["return"] == r["return"] and rec["score"] == r["score"] and rec["ops"] == r["ops"]
        assert _memory(rec) == _memory(r)
    # the policy was asked only for the steps after each prefix
    assert policy.asked == sum(len(r["steps"]) - t for r, t in forks)


def test_a_fork_continues_under_another_policy_without_touching_the_original():
    """From the answer phase a different policy takes over (here one that writes garbage): the fork's episode
    ends with its own outcome (an error observation, no crash), the original's record is what it was."""
    tasks = generate_tasks(2, seed=99, docs=3, questions=1, confounders=0)
    orig = sorted(run_rollouts(tasks, make_policy("oracle"), ENV, seed=0), key=lambda r: r["key"])
    before = json.dumps(orig, default=str)
    replay = {k: {"seed": k, "actions": [s["completion"] for s in r["steps"] if s["phase"] != "answer"]}
              for k, r in enumerate(orig)}

    class Garbage(Policy):
        name = "garbage"

        def act_one(self, key, obs, info):
            return '<tool_call>{"name": "answer", "arguments": {"oops": 1}}</tool_call> }}{{ \x00'

    out = sorted(run_rollouts(tasks, Garbage(), ENV, seed=0, replay=replay), key=lambda r: r["key"])
    assert json.dumps(orig, default=str) == before
    for o, f in zip(orig, out, strict=True):
        assert not f["crashed"] and o["em"] == 1.0 and f["em"] == 0.0 and f["tool_errors"] >= 1
        replayed = [s for s in f["steps"] if s.get("replayed")]
        assert [s["completion"] for s in replayed] == replay[o["key"]]["actions"]
        assert [s["prompt"] for s in replayed] == [s["prompt"] for s in o["steps"][:len(replayed)]]


def test_replay_of_a_bad_prefix_is_an_error_observation_not_a_crash():
    tasks = generate_tasks(1, seed=3, docs=3, questions=1, confounders=0)
    out = run_rollouts(tasks, make_policy("oracle"), ENV, replay={0: {"seed": 0, "actions": ["not a call", '<tool_call>{"name": </tool_call>']}})
    assert not out[0]["crashed"] and out[0]["steps"][0]["replayed"] and out[0]["format_errors"] >= 1


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])


# --------------------------------------------------------------------------- fork credit


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from atommem_rl.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_step_advantages_by_hand():
    from atommem_rl.training.fork_credit import fork_plan, fork_values, step_advantages

    # a group of 3: episode 0 answered right from a good memory, 1 wrong from a good memory, 2 has no answer phase
    recs = [{"steps": [{"phase": "chunks", "completion": "a"}, {"phase": "answer", "completion": "x"}]},
            {"steps": [{"phase": "chunks", "completion": "b"}, {"phase": "chunks", "completion": "c"},
                       {"phase": "answer", "completion": "y"}]},
            {"steps": [{"phase": "chunks", "completion": "d"}]}]
    owners, replay = fork_plan(recs, forks=2, seed=10)
    assert owners == [0, 0, 1, 1]
    assert replay[0] == {"seed": 10, "actions": ["a"]} and replay[2] == {"seed": 11, "actions": ["b", "c"]}
    values = fork_values(owners, [1.0, 0.0, 1.0, 1.0], 3)
    assert values == [0.5, 1.0, None]
    returns = [1.0, 0.0, 0.0]
    q = [(1.0 + 2 * 0.5) / 3, (0.0 + 2 * 1.0) / 3, 0.0]
    b = sum(q) / 3
    adv = step_advantages(returns, values, [1, 2, None], [2, 3, 1], [b] * 3, forks=2)
    assert adv[0] == pytest.approx([q[0] - b, 1.0 - 0.5])
    assert adv[1] == pytest.approx([q[1] - b, q[1] - b, 0.0 - 1.0])  # good memory, bad answer: split
    assert adv[2] == pytest.approx([0.0 - b])
    # K = 0 is GRPO's terminal advantage
    flat = [a for ep in step_advantages(returns, [None] * 3, [1, 2, None], [2, 3, 1], [1 / 3] * 3, forks=0) for a in ep]
    assert flat == pytest.approx([2 / 3] * 2 + [-1 / 3] * 3 + [-1 / 3])
    with pytest.raises(ValueError):
        fork_plan(recs, forks=-1, seed=0)


def test_fork_credit_trains_with_step_level_advantages(tiny, tmp_path, monkeypatch):
    """The trainer forks every episode at its answer phase (replaying its recorded actions), rolls the forks out
    with the policy in the same rounds machinery, and gives chunk and answer steps their own advantages, equal to
    the by-hand values from the recorded returns; the optimizer step moves the weights. Returns are scripted
    from each episode's completions (the tiny model never answers right), forks included."""
    import hashlib

    import torch

    from atommem_rl.training import grpo
    from atommem_rl.training.grpo import build_trainer

    from .test_grpo import small_config

    calls = []
    real = grpo.run_rollouts

    def scripted(tasks, policy, env_config, **kw):
        recs = real(tasks, policy, env_config, **kw)
        for r in recs:
            text = "\x1e".join(s["completion"] for s in r["steps"])
            r["return"] = int(hashlib.sha1(text.encode()).hexdigest(), 16) % 101 / 100
        calls.append((kw.get("replay"), {r["key"]: r for r in recs}))
        return recs

    monkeypatch.setattr(grpo, "run_rollouts", scripted)
    cfg = small_config(tiny, tmp_path / "fc", fork_credit=2, per_device_train_batch_size=4, num_generations=4,
                       synth_tasks=1, env_config={"chunk_tokens": 48, "max_prompt_tokens": 2048, "max_answer_steps": 1})
    trainer = build_trainer(cfg)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = trainer._generate_and_score_completions([trainer.train_dataset[0]] * 4)
    (main_replay, main), (replay, forks) = calls
    assert main_replay is None and len(replay) == 2 * 4  # every episode reached its answer phase
    R = [main[k]["return"] for k in range(4)]
    V = [sum(forks[i]["return"] for i in replay if i // 2 == k) / 2 for k in range(4)]
    for i, spec in replay.items():  # a fork replays its episode's steps before the answer phase, then answers
        steps = forks[i]["steps"]
        assert [s["completion"] for s in steps if s.get("replayed")] == spec["actions"]
        assert steps[-1]["phase"] == "answer" and not steps[-1].get("replayed")
    Q = [(r + 2 * v) / 3 for r, v in zip(R, V)]
    b = sum(Q) / 4
    expected = []
    for k in range(4):
        t = next(i for i, s in enumerate(main[k]["steps"]) if s["phase"] == "answer")
        expected += [Q[k] - b] * t + [R[k] - V[k]] * (len(main[k]["steps"]) - t)
    got = batch["advantages"][: len(expected)].tolist()
    assert got == pytest.approx(expected, abs=1e-6)
    assert len(set(round(a, 6) for a in got)) > 4  # steps of one episode carry different advantages
    assert trainer._metrics["train"]["fork/rollouts"][-1] == 8

    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, batch)
    trainer.accelerator.backward(loss)
    torch.optim.SGD(trainer.model.parameters(), lr=1e-2).step()
    moved = sum(int(not torch.equal(a, p)) for a, p in zip(before, trainer.model.parameters()))
    assert moved > 0


def test_fork_credit_refusals(tiny, tmp_path):
    from atommem_rl.training import ppo

    from .test_grpo import small_config

    with pytest.raises(ValueError, match="scale_rewards none"):
        small_config(tiny, tmp_path / "a", fork_credit=2, scale_rewards="group")
    with pytest.raises(ValueError, match="fork_credit must be"):
        small_config(tiny, tmp_path / "b", fork_credit=-1)
    with pytest.raises(ValueError, match="critic"):
        small_config(tiny, tmp_path / "c", cls=ppo.PPORecipeConfig, fork_credit=2)
