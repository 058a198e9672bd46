"""The model policy batches every active episode of a step into one Hugging Face generate call
(a random-weight tiny Llama with the real SmolLM2 tokenizer: its output is noise, the env survives)."""

from __future__ import annotations

import pytest
import torch

from atommem_rl.policies.model_policy import ModelPolicy
from atommem_rl.rollout import run_rollouts, summarize
from atommem_rl.tasks.synth import generate_tasks
from envs.tokens import cached_smollm2_tokenizer


@pytest.mark.slow
def test_hf_generate_batches_episodes():
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = cached_smollm2_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    policy = ModelPolicy(LlamaForCausalLM(cfg), tok, max_new_tokens=8)
    tasks = generate_tasks(3, seed=2, docs=4, questions=1, confounders=0)
    tr = run_rollouts(tasks, policy, dict(tokenizer=tok, chunk_tokens=128, max_prompt_tokens=2048, max_answer_steps=1),
                      batch_size=3)
    s = summarize(tr, "model")
    assert s["episodes"] == 3 and s["crashes"] == 0
    steps = max(len(t["steps"]) for t in tr)
    assert policy.calls == steps  # one generation call per step for all active episodes
