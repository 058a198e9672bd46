"""The trainer's packed policy update (max_tokens_per_microbatch > 0) against TRL's padded rows, on the same
step samples of one generation batch: loss and gradients equal in fp32 (tiny random-weight Llama and Qwen3,
scripted non-zero advantages so the weights move), every packed micro-batch within its token budget, equal
micro-batch counts padded with empty ones, episode weighting by hand, and refusals."""

import pytest
import torch

from atommem_rl.training.grpo import GRPORecipeConfig, StepwiseGRPOTrainer, build_trainer

from .test_grpo import small_config

SCRIPTED = [0.7, -0.3, 0.5, -0.9]  # per episode: every group informative


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_arch(request, tmp_path_factory):
    from atommem_rl.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp(f"tiny_{request.param}") / "model", arch=request.param)


def _trainer(tiny, out, monkeypatch, **kw):
    monkeypatch.setattr(StepwiseGRPOTrainer, "_advantages", lambda self, recs, *a: SCRIPTED[: len(recs)])
    cfg = small_config(tiny, out, synth_tasks=2, steps_per_generation=2, gradient_accumulation_steps=2, **kw)
    trainer = build_trainer(cfg)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    return trainer


def _grads(trainer, micro_steps) -> tuple[float, list[torch.Tensor]]:
    trainer.model.zero_grad(set_to_none=True)
    total = 0.0
    for inputs in micro_steps:
        loss = trainer.compute_loss(trainer.model, inputs)
        trainer.accelerator.backward(loss)
        total += loss.item()
    return total, [p.grad.detach().clone() for p in trainer.model.parameters() if p.requires_grad]


@pytest.mark.timeout(600)
def test_packed_update_equals_row_update(tiny_arch, tmp_path, monkeypatch):
    from trl.trainer.utils import split_tensor_dict

    trainer = _trainer(tiny_arch, tmp_path / "t", monkeypatch)
    rows = [trainer.train_dataset[0]] * 2 + [trainer.train_dataset[1]] * 2
    batch = trainer._generate_and_score_completions(rows)
    assert torch.any(batch["advantages"] != 0)
    row_loss, row_grads = _grads(trainer, split_tensor_dict(batch, 2))

    lengths = (batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1)).tolist()
    budget = int(max(lengths)) + 64  # several micro-batches: a group never fits one alone
    trainer.args.max_tokens_per_microbatch = budget
    steps = trainer._pack_generation_batch(batch)
    assert len(steps) == 2
    micro = [m for s in steps for m in s["packed_microbatches"]]
    assert len(micro) > 2, "the budget should force more packed micro-batches than micro-steps"
    assert all(m["packed"]["forwarded_tokens"] <= budget for m in micro)
    raw = sum(lengths[i] for i in range(len(lengths)) if batch["completion_mask"][i].sum() > 0)
    assert sum(m["packed"]["forwarded_tokens"] for m in micro) < raw  # the shared prefix is forwarded once per row
    pk_loss, pk_grads = _grads(trainer, steps)

    assert pk_loss == pytest.approx(row_loss, rel=1e-5, abs=1e-6)
    flat_r, flat_p = torch.cat([g.flatten() for g in row_grads]), torch.cat([g.flatten() for g in pk_grads])
    assert flat_r.abs().max() > 0  # the weights would move
    cos = torch.nn.functional.cosine_similarity(flat_r, flat_p, dim=0).item()
    assert cos >= 0.9999, cos
    assert (flat_r - flat_p).abs().max().item() <= 1e-4 * max(flat_r.abs().max().item(), 1.0)


@pytest.mark.timeout(600)
def test_packed_old_and_reference_scores_equal_row_scores(tiny, tmp_path, monkeypatch):
    """With packing on, the no-gradient passes (old-policy log-probabilities for the importance-sampling
    correction or several updates per generation, reference log-probabilities for the KL term) are packed
    too: the same values as TRL's padded rows on every trained token (fp32), zeros elsewhere; the KL
    term then enters the packed loss like the rows' one."""
    from trl.trainer.utils import split_tensor_dict

    trainer = _trainer(tiny, tmp_path / "t", monkeypatch, beta=0.04)
    rows = [trainer.train_dataset[0]] * 2 + [trainer.train_dataset[1]] * 2
    batch = trainer._generate_and_score_completions(rows)  # rows: ref from padded rows
    mask = batch["completion_mask"].bool()
    assert mask.sum() > 0 and trainer.ref_model is not None
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        att = torch.cat([batch["prompt_mask"], torch.ones_like(batch["completion_mask"])], dim=1)
        old_rows = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, batch["completion_ids"].size(1),
                                                              batch_size=4)[0]
    budget = int((batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1)).max()) + 64
    trainer.args.max_tokens_per_microbatch = budget  # several packed forwards
    old_packed = trainer._packed_scores(batch, trainer.model)
    ref_packed = trainer._packed_ref_logps(batch)
    assert old_packed.shape == old_rows.shape and torch.all(old_packed[~mask] == 0)
    assert (old_packed - old_rows)[mask].abs().max().item() <= 1e-4
    assert (ref_packed - batch["ref_per_token_logps"])[mask].abs().max().item() <= 1e-4
    # the whole path: _score_old_and_ref now fills ref_per_token_logps from packed forwards, not padded rows
    monkeypatch.setattr(trainer, "_ref_logps", lambda *a, **k: pytest.fail("padded-row reference pass"))
    packed_batch = trainer._generate_and_score_completions(rows)
    assert (packed_batch["ref_per_token_logps"] - batch["ref_per_token_logps"])[mask].abs().max().item() <= 1e-4
    # and the loss with its KL term: after one SGD step the policy differs from the reference, then
    # packed and row losses (KL included) agree
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(1e-2 * torch.randn_like(p))
    row_loss, _ = _grads(trainer, split_tensor_dict(batch, 2))
    pk_loss, _ = _grads(trainer, trainer._pack_generation_batch(packed_batch))
    assert pk_loss == pytest.approx(row_loss, rel=1e-4, abs=1e-6)


@pytest.mark.timeout(600)
def test_packed_counts_padded_to_micro_steps_and_empty_rows_add_zero(tiny, tmp_path, monkeypatch):
    """A budget that packs everything in one micro-batch still gives steps_per_generation micro-steps (the
    second gets an empty micro-batch, whose loss is exactly 0 and connected to the weights)."""
    trainer = _trainer(tiny, tmp_path / "t", monkeypatch, max_tokens_per_microbatch=200_000)
    rows = [trainer.train_dataset[0]] * 2 + [trainer.train_dataset[1]] * 2
    steps = trainer._pack_generation_batch(trainer._generate_and_score_completions(rows))
    assert [len(s["packed_microbatches"]) for s in steps] == [1, 1]
    empty = steps[1]["packed_microbatches"][0]
    assert empty["rows"]["completion_mask"].sum() == 0 and empty["packed"]["forwarded_tokens"] == 2
    trainer.args.zero_advantage = "train"
    loss = trainer.compute_loss(trainer.model, steps[1])
    assert loss.item() == 0.0 and loss.requires_grad


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from atommem_rl.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.timeout(600)
def test_episode_weighting_by_hand(tiny, tmp_path, monkeypatch):
    """loss_weighting episode: each row's advantage carries N / (E x n_e), so the token-sum loss over N is
    the mean over episodes of each episode's token mean."""
    trainer = _trainer(tiny, tmp_path / "t", monkeypatch, loss_weighting="episode")
    rows = [trainer.train_dataset[0]] * 2 + [trainer.train_dataset[1]] * 2
    batch = trainer._generate_and_score_completions(rows)
    tokens = batch["completion_mask"].sum(1).float()
    n = tokens.sum()
    per_ep: dict = {}
    for (e, _), k in zip(trainer._sample_meta, tokens.tolist()):
        if e is not None:
            per_ep[e] = per_ep.get(e, 0.0) + k
    eps = sum(1 for v in per_ep.values() if v)
    for (e, _), a, k in zip(trainer._sample_meta, batch["advantages"].tolist(), tokens.tolist()):
        if e is None or not k:
            continue
        assert a == pytest.approx(SCRIPTED[e] * n.item() / (eps * per_ep[e]), rel=1e-5)
    # every episode's weights sum to 1 / E: sum over its tokens of scale / N
    for e, v in per_ep.items():
        assert v * (n.item() / (eps * v)) / n.item() == pytest.approx(1 / eps)


def test_packing_refusals(tiny, tmp_path):
    for bad, match in [(dict(loss_type="grpo"), "loss_type"), (dict(top_entropy_quantile=0.5), "top_entropy"),
                       (dict(max_tokens_per_microbatch=1), "at least 2")]:
        kw = dict(max_tokens_per_microbatch=4096)
        kw.update(bad)
        with pytest.raises(ValueError, match=match):
            build_trainer(small_config(tiny, tmp_path / "r", **kw))
    with pytest.raises(ValueError, match="beta"):
        build_trainer(small_config(tiny, tmp_path / "r", loss_weighting="episode", beta=0.1))
    with pytest.raises(ValueError, match="loss_weighting"):
        GRPORecipeConfig(output_dir=str(tmp_path / "x"), loss_weighting="steps", report_to="none", use_cpu=True)


@pytest.mark.timeout(600)
def test_two_ranks_run_equal_packed_microbatches_and_match_rows(tiny, tmp_path):
    """Two gloo ranks with different sample counts (rank 1 drops a zero-advantage group): both run the same
    number of packed micro-batches per micro-step (the shorter padded with empty ones), and the
    all-reduced packed gradients equal the row path's under DDP on both ranks."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from .conftest import REPO, free_port

    out = tmp_path / "ranks.jsonl"
    accelerate = Path(sys.executable).with_name("accelerate")
    res = subprocess.run([str(accelerate), "launch", "--config_file", str(REPO / "recipes/accelerate/cpu_2proc.yaml"),
                          "--main_process_port", str(free_port()), str(REPO / "tests/packing_ranks.py"), str(tiny),
                          str(out), str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["samples"] > ranks[1]["samples"]  # uneven work
    assert ranks[0]["per_step"] == ranks[1]["per_step"]  # equal collectives
    assert sum(ranks[0]["per_step"]) >= ranks[0]["planned"] > ranks[1]["planned"]
    for r in ranks:
        assert r["grad_max"] > 0 and r["cosine"] >= 0.9999 and r["max_diff"] <= 1e-4 * max(r["grad_max"], 1.0)
        assert r["packed_loss"] == pytest.approx(r["row_loss"], rel=1e-5, abs=1e-6)
    assert ranks[0]["grad_sum"] == pytest.approx(ranks[1]["grad_sum"], rel=1e-6)  # all-reduced: the same


@pytest.mark.timeout(900)
def test_packed_training_step_moves_weights_as_rows_do(tiny, tmp_path, monkeypatch):
    """One optimizer step through the Trainer's loop (its _prepare_inputs buffering and training_step, two
    micro-steps), rows against packing under a budget that makes several packed micro-batches: the same
    seeded rollouts, the same scripted advantages, and weights that moved, equally within 1e-4 of the largest
    move. Plain SGD, so the move is lr * g: Adam's first step lr * g / (|g| + eps) turns 1e-9 gradient
    differences on entries near eps into 2% of lr (measured 1.8e-5 at lr 1e-3)."""
    from safetensors.torch import load_file

    from atommem_rl.training.grpo import train

    monkeypatch.setattr(StepwiseGRPOTrainer, "_advantages", lambda self, recs, *a: SCRIPTED[: len(recs)])
    w0 = load_file(tiny / "model.safetensors")
    moved = {}
    for name, budget in (("rows", 0), ("packed", 1200)):
        cfg = small_config(tiny, tmp_path / name, synth_tasks=2, steps_per_generation=2, gradient_accumulation_steps=2,
                           per_device_train_batch_size=2,
                           max_tokens_per_microbatch=budget, save_steps=100, learning_rate=1.0, optim="sgd",
                           max_grad_norm=0.0)
        train(cfg)
        moved[name] = load_file(tmp_path / name / "model.safetensors")
    for k, v in w0.items():
        if k not in moved["rows"]:
            continue
        d_rows, d_packed = moved["rows"][k] - v, moved["packed"][k] - v
        assert (d_packed - d_rows).abs().max().item() <= 1e-4 * max(d_rows.abs().max().item(), 1e-6), k
    assert max((moved["rows"][k] - w0[k]).abs().max().item() for k in moved["rows"]) > 1e-4


def test_auto_bf16_follows_the_cpu(tmp_path):
    from atommem_rl.precision import cpu_bf16_supported

    cfg = GRPORecipeConfig(output_dir=str(tmp_path / "x"), report_to="none", use_cpu=True, auto_bf16=True, bf16=False)
    assert cfg.bf16 == cpu_bf16_supported() and not cfg.fp16
    assert GRPORecipeConfig(output_dir=str(tmp_path / "y"), report_to="none", use_cpu=True, bf16=False).bf16 is False
