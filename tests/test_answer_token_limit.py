"""The environment's answer-phase completion limit (``answer_max_new_tokens``): the env announces it in
``info["max_new_tokens"]`` for answer-phase observations only; the evaluation's policy, the model policy
and the trainer's rollouts stop each such reply there, and a reply so cut is the same tokens as the
unlimited reply's start (the limit cuts, it does not change what is generated)."""

from __future__ import annotations

import pytest
import torch

from atommem_rl.policies.base import step_token_limit
from atommem_rl.tasks.synth import generate_task
from envs import make_env


def test_the_env_announces_its_limit_in_the_answer_phase_only():
    task = generate_task(0, docs=2, questions=1)
    with pytest.raises(ValueError, match="answer_max_new_tokens must be an integer >= 1"):
        make_env(task, answer_max_new_tokens=0)
    env = make_env(task, chunk_tokens=64, tokenizer="words", answer_max_new_tokens=5)
    _, info = env.reset(seed=0)
    assert info["phase"] == "chunks" and info["max_new_tokens"] is None
    while info["phase"] == "chunks":
        _, _, _, _, info = env.step("")
    assert info["max_new_tokens"] == 5
    _, info = make_env(task, chunk_tokens=64, tokenizer="words").reset(seed=0)
    assert info["max_new_tokens"] is None


def test_step_token_limit_takes_the_smaller():
    assert step_token_limit({}, 224) == 224
    assert step_token_limit(None, 224) == 224
    assert step_token_limit({"max_new_tokens": None}, 224) == 224
    assert step_token_limit({"max_new_tokens": 64}, 224) == 64
    assert step_token_limit({"max_new_tokens": 500}, 224) == 224


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from atommem_rl.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_greedy_rows_stop_at_their_own_limits(tiny):
    from transformers import GenerationConfig

    from atommem_rl.inference.compact_decode import generate_dropping_finished, row_token_limits
    from atommem_rl.models import load_policy

    model, tok = load_policy(tiny)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11, 12], [5, 6, 7, 13, 14, 15]])
    mask = torch.ones_like(ids)
    config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    full = generate_dropping_finished(model, ids, mask, generation_config=config)
    with row_token_limits([3, 12, 1]):
        cut = generate_dropping_finished(model, ids, mask, generation_config=config)
    with row_token_limits([3, 12]):  # another number of rows: ignored
        same = generate_dropping_finished(model, ids, mask, generation_config=config)
    assert torch.equal(same, full)
    new_full, new_cut = full[:, ids.size(1):], cut[:, ids.size(1):]
    assert new_full.size(1) == 12 and new_cut.size(1) == 12
    assert torch.equal(new_cut[0, :3], new_full[0, :3]) and torch.equal(new_cut[1], new_full[1])
    assert torch.equal(new_cut[2, :1], new_full[2, :1])
    assert new_cut[0, 3:].eq(0).all() and new_cut[2, 1:].eq(0).all()  # padding after each row's limit


def test_the_evaluation_policy_cuts_answer_steps(tiny):
    from atommem_rl.eval.harness import BackendPolicy
    from atommem_rl.inference.chat_backends import HFBackend

    backend = HFBackend(str(tiny), batch_size=4)
    policy = BackendPolicy(backend, 16)
    obs = [{"role": "user", "content": "Where does Ada live now?"}]
    full, cut = policy.act([("a", obs, {}), ("b", obs, {"max_new_tokens": 3})])
    used = {k: backend.take_usage(k)["completion_tokens"] for k in ("a", "b")}
    assert used["b"] == 3 < used["a"]  # the tiny random model does not stop by itself within 16 tokens
    assert full.startswith(cut)


def _small(tiny, out, **kw):
    from atommem_rl.training.grpo import GRPORecipeConfig

    env = {"chunk_tokens": 64, "max_prompt_tokens": 2048, "max_answer_steps": 1, "answer_max_new_tokens": 3}
    base = dict(model_name_or_path=str(tiny), output_dir=str(out), use_cpu=True, bf16=False,
                per_device_train_batch_size=4, num_generations=2, max_completion_length=16, max_steps=1,
                logging_steps=1, save_steps=1, report_to="none", gradient_checkpointing=False,
                learning_rate=1e-3, synth_tasks=1, synth_docs=1, synth_questions=1, synth_confounders=0,
                env_config=env, seed=0)
    base.update(kw)
    return GRPORecipeConfig(**base)


@pytest.mark.slow
@pytest.mark.parametrize("compact", [True, False], ids=["rows-leave", "generate"])
def test_rollouts_cut_answer_steps_at_the_env_limit(tiny, tmp_path, compact):
    """Both generation paths: rows stopping at their own limit inside the decode (shared-prefix generation
    with rows leaving) and plain ``generate`` to max_completion_length, cut afterwards. The answer steps
    are the unlimited run's first 3 tokens (seeded sampling: a step's tokens depend on its prompt and
    seed only); the reading steps are untouched; a cut reply counts as truncated (no EOS: no loss)."""
    from atommem_rl.training.grpo import build_trainer

    def steps(limit):
        cfg = _small(tiny, tmp_path / f"run{limit}", shared_prefix_generation=compact)
        if limit is None:
            cfg.env_config = {k: v for k, v in cfg.env_config.items() if k != "answer_max_new_tokens"}
        trainer = build_trainer(cfg)
        rows = [trainer.train_dataset[0]] * 2
        trainer.model.train()
        batch = trainer._generate_and_score_completions(rows)
        ids, mask = batch["completion_ids"], batch["completion_mask"]
        return [ids[i][: int(mask[i].sum())].tolist() for i in range(ids.size(0))], trainer._prefill[2]

    (full, full_steps), (cut, cut_steps) = steps(None), steps(3)
    # the decode itself stopped the answer rows (rows x decode steps), not only the cut afterwards
    assert (cut_steps < full_steps) if compact else (cut_steps == full_steps == 0)
    assert len(full) == len(cut) == 4  # 2 episodes x (reading step, answer step)
    for reading in (0, 2):
        assert cut[reading] == full[reading] and len(full[reading]) > 3
    for answer in (1, 3):
        assert len(full[answer]) > 3 and cut[answer] == full[answer][:3]


def test_a_vllm_server_round_asks_each_prompt_for_its_own_limit():
    """Through a vLLM server each request carries its own ``max_tokens`` (the server stops there)."""
    from types import SimpleNamespace

    from atommem_rl.training.rounds import TrainerPolicy

    class Client:  # scripts the server: a completion as long as the request allows
        def generate(self, prompts, generation_kwargs=None, **params):
            return {"prompt_ids": prompts, "completion_ids": [[7] * params["max_tokens"]], "logprobs": None}

    vg = SimpleNamespace(vllm_client=Client(), repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0,
                         min_p=0.0, max_completion_length=16, logprobs=None, structured_outputs_regex=None,
                         generation_kwargs={})
    completions, _, echoed = TrainerPolicy._ask_server(vg, [([1, 2], 0, 16), ([1, 3], 1, 3)])
    assert [len(c) for c in completions] == [16, 3] and echoed == [[1, 2], [1, 3]]
