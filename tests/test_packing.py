"""Prefix-shared packing (atommem_rl/training/packing.py) and tree attention on CPU
(atommem_rl/training/tree_attention.py): exactness against unpacked forwards on tiny random-weight
Llama and Qwen3 models in fp32 (log-probabilities and GRPO gradients), the token budget, equal
micro-batch counts across ranks, and per-episode loss weights."""

from __future__ import annotations

import random

import pytest
import torch

from atommem_rl.training.packing import (grpo_loss, microbatch_inputs, pad_microbatches, packed_logprobs,
                                         per_sample_logprobs, plan_microbatches, step_group_ids, token_weights,
                                         tree_samples, unique_tokens)

GROUP = 3  # episodes per task


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from atommem_rl.models import tiny_model

    path = tiny_model(tmp_path_factory.mktemp(request.param) / "m", arch=request.param, hidden_size=32, heads=2,
                      kv_heads=1, intermediate_size=64)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    return m.eval()  # dropout off: packed and unpacked see the same function


def _episodes(seed: int = 0, tasks: int = 2, steps: int = 3, vocab: int = 1000):
    """Step samples shaped like the environment's: a shared system prompt, the task's chunk at step t,
    then per-episode parts and a completion; one episode ends a step early, two episodes repeat a step."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(5, vocab) for _ in range(n)]  # noqa: E731
    system = tok(40)
    chunks = {(k, t): tok(rng.randrange(10, 20)) for k in range(tasks) for t in range(steps)}
    episodes, advantages = [], []
    for e in range(tasks * GROUP):
        k, n_steps = e // GROUP, steps - (e % GROUP == 2)
        eps = []
        for t in range(n_steps):
            prompt = system + chunks[(k, t)] + tok(rng.randrange(3, 9))
            eps.append((prompt, tok(rng.randrange(2, 7)), None))
        episodes.append(eps)
        advantages.append(rng.choice([-1.0, -0.5, 0.5, 1.0]))
    episodes[1][0] = episodes[0][0]  # identical step sample: same prompt and completion
    advantages[-1] = 0.0  # a zero advantage still counts its tokens
    return episodes, advantages


def _batch(seed: int = 0):
    from atommem_rl.training.grpo import step_samples

    episodes, adv = _episodes(seed)
    samples = step_samples(episodes, adv)
    return samples, tree_samples(samples, step_group_ids(episodes, GROUP)), episodes


def _reference_logprobs(model, samples):
    """Each sample forwarded alone (no padding), log-softmax of the full logits."""
    out = []
    for prompt, completion, _, _ in samples:
        ids = torch.tensor([prompt + completion])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        out.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0])
    return out


def _weights(samples, episodes, mode="token"):
    ep = [e for e, steps in enumerate(episodes) for _ in steps]
    return torch.tensor(token_weights(ep, [len(s[1]) for s in samples], mode))


def _grad(model):
    g = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return g


@pytest.mark.parametrize("budget", [10_000, 120])
def test_packed_logprobs_and_gradients_equal_unpacked(model, budget):
    samples, trees, episodes = _batch()
    weights = _weights(samples, episodes)
    ref = _reference_logprobs(model, samples)
    ref_loss = sum(grpo_loss(lp, {"sample_index": torch.full_like(lp, i, dtype=torch.long),
                                  "advantages": torch.full_like(lp, samples[i][3])}, weights)
                   for i, lp in enumerate(ref))
    ref_loss.backward()
    g_ref = _grad(model)

    rows = plan_microbatches(trees, budget)
    assert (len(rows) == 1) == (budget == 10_000)
    got: list[list[float]] = [[] for _ in samples]
    raw = sum(len(s["input_ids"]) for s in trees)
    forwarded = 0
    for row in rows:
        inputs = microbatch_inputs(row, pad_token_id=0)
        forwarded += inputs["forwarded_tokens"]
        lp = packed_logprobs(model, inputs)
        grpo_loss(lp, inputs, weights).backward()
        for i, v in enumerate(per_sample_logprobs(lp.detach(), inputs, len(samples))):
            got[i] += v
    g_packed = _grad(model)
    assert forwarded < raw  # the shared prefixes were forwarded once per micro-batch
    diff = max((torch.tensor(g) - r.detach()).abs().max().item() for g, r in zip(got, ref))
    assert diff <= 1e-4, diff
    cos = torch.nn.functional.cosine_similarity(g_packed, g_ref, dim=0).item()
    assert cos >= 0.9999, cos
    assert (g_packed - g_ref).norm() <= 1e-3 * g_ref.norm()
    # the unpacked path (left-padded rows with a mask, as generate and TRL's rows) computes what it did before
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_pretrained(model.name_or_path, dtype=torch.float32, attn_implementation="sdpa")
    ids = torch.tensor([[0, 0] + samples[0][0][:12], samples[1][0][:14]])
    mask = torch.tensor([[0, 0] + [1] * 12, [1] * 14])
    with torch.no_grad():
        diff = (model(input_ids=ids, attention_mask=mask).logits - fresh.eval()(input_ids=ids, attention_mask=mask).logits)
    assert diff[mask.bool()].abs().max() <= 1e-5


def test_packed_backward_under_gradient_checkpointing(model):
    """Gradient checkpointing runs each layer's forward again during backward: the packed micro-batch's
    gradient is the same with it as without (the tree attention still holds when the layers are
    recomputed; a model switched back to its own attention after the forward made torch refuse the
    recomputation, "a different number of tensors was saved")."""
    samples, trees, episodes = _batch()
    weights = _weights(samples, episodes)
    (row,) = plan_microbatches(trees, 10_000)
    inputs = microbatch_inputs(row, pad_token_id=0)
    grads = {}
    try:
        for checkpointing in (False, True):
            if checkpointing:  # as the recipes (TRL's default kwargs); HF checkpoints only in train mode
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                model.train()
            grpo_loss(packed_logprobs(model, inputs), inputs, weights).backward()
            grads[checkpointing] = _grad(model)
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    assert grads[False].norm() > 0
    assert torch.nn.functional.cosine_similarity(grads[True], grads[False], dim=0).item() >= 0.99999
    assert (grads[True] - grads[False]).norm() <= 1e-5 * grads[False].norm()


def test_scoring_all_positions_gives_the_same_logprobs(model):
    _, trees, _ = _batch(1)
    inputs = microbatch_inputs(plan_microbatches(trees, 10_000)[0], pad_token_id=0)
    with torch.no_grad():
        a = packed_logprobs(model, inputs, score="trained")
        b = packed_logprobs(model, inputs, score="all")
    assert a.shape == inputs["token_index"].shape
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_empty_microbatch_runs_and_adds_zero(model):
    (row,) = pad_microbatches([], 1)
    inputs = microbatch_inputs(row, pad_token_id=0)
    assert inputs["forwarded_tokens"] == 2 and inputs["sample_index"].tolist() == [-1]
    lp = packed_logprobs(model, inputs)
    grpo_loss(lp, inputs, torch.ones(1)).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and not g.any() for g in grads)  # every parameter in the graph, all zero
    model.zero_grad(set_to_none=True)


def test_budget_bounds_unique_tokens_and_ranks_get_equal_counts():
    rng = random.Random(3)
    samples, groups = [], []
    system = [rng.randrange(5, 500) for _ in range(30)]
    for i in range(60):
        g = i % 7
        chunk = [g + 5] * 12
        samples.append((system + chunk + [rng.randrange(5, 500) for _ in range(rng.randrange(1, 20))],
                        [rng.randrange(5, 500) for _ in range(rng.randrange(1, 15))], None, 1.0))
        groups.append((g, 0))
    trees = tree_samples(samples, groups)
    for budget in (80, 150, 400):
        rows = plan_microbatches(trees, budget)
        assert all(unique_tokens(r) <= budget and r.trained <= budget for r in rows)
        placed = sorted(s["index"] for r in rows for s in r.samples)
        assert placed == list(range(len(samples)))  # every sample once, none dropped
        # a group is not split while its home row has room: at most a few rows per group
        assert len(rows) < len(samples)
    # ranks pad to the largest count with empty micro-batches
    per_rank = [plan_microbatches(trees[:20], 150), plan_microbatches(trees, 150)]
    count = max(len(r) for r in per_rank)
    padded = [pad_microbatches(r, count) for r in per_rank]
    assert {len(p) for p in padded} == {count}
    assert all(not r.samples for r in padded[0][len(per_rank[0]):])
    with pytest.raises(ValueError):
        pad_microbatches(per_rank[1], count - 1)


def test_oversize_sample_gets_its_own_microbatch():
    trees = tree_samples([([5] * 50, [6] * 10, None, 1.0), ([5] * 4, [7], None, 1.0)], [(0, 0), (0, 1)])
    with pytest.warns(UserWarning, match="exceeds"):
        rows = plan_microbatches(trees, 20)
    assert [len(r.samples) for r in rows] == [1, 1]


def test_token_weights_token_mean_and_per_episode():
    episode = [0, 0, 0, 1, 2, 2]
    tokens = [10, 20, 30, 5, 0, 15]
    w = token_weights(episode, tokens, "token")
    assert sum(wi * n for wi, n in zip(w, tokens)) == pytest.approx(1.0)
    assert len(set(w)) == 1
    assert token_weights(episode, tokens, "token", total_tokens=160)[0] == pytest.approx(1 / 160)
    w = token_weights(episode, tokens, "episode")
    per_ep = {}
    for e, wi, n in zip(episode, w, tokens):
        per_ep[e] = per_ep.get(e, 0.0) + wi * n
    assert per_ep == pytest.approx({0: 1 / 3, 1: 1 / 3, 2: 1 / 3})  # equal whatever the steps
    # over ranks: episodes counted globally
    assert sum(wi * n for wi, n in zip(token_weights(episode, tokens, "episode", total_episodes=6), tokens)) == \
        pytest.approx(0.5)
    # equal-length episodes: the two normalisations agree
    assert token_weights([0, 0, 1, 1], [4, 6, 5, 5], "episode") == pytest.approx(token_weights([0, 0, 1, 1], [4, 6, 5, 5]))
    # an episode without trained tokens weighs nothing and does not count
    assert token_weights([0, 1], [0, 8], "episode") == [0.0, pytest.approx(1 / 8)]
    with pytest.raises(ValueError):
        token_weights([0], [1], "sample")


def test_packing_projection_script_on_real_prompts():
    """scripts/packing_projection.py on real HotpotQA step prompts (random policy, a group of 3): the packed
    path forwards fewer tokens than the samples hold, which are no more than the padded rows."""
    import json
    import subprocess
    import sys

    from .conftest import REPO

    res = subprocess.run([sys.executable, str(REPO / "scripts/packing_projection.py"), "--groups", "1",
                          "--group-size", "3", "--max-steps", "2", "--chunk-tokens", "512", "--max-prompt-tokens",
                          "4096", "--max-tokens", "4096"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["samples"] == 6 and out["micro_batches"] >= 1
    assert out["forwarded_tokens"] < out["raw_tokens"] <= out["padded_tokens"]
    assert out["largest_microbatch_tokens"] <= 4096 or out["micro_batches"] == out["samples"]
