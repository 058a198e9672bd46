"""One reader/policy model behind one interface, with every call and token counted per task.

``Backend.generate(requests)`` takes :class:`Request` objects (chat messages, ``max_new_tokens``,
the key of the task they belong to) and returns one text per request, in order. Every request is
one LLM call: ``usage[key]`` accumulates ``calls``, ``prompt_tokens`` (the rendered chat prompt the
model actually read) and ``completion_tokens`` (generated tokens up to and including the end token),
and the same split by the request's ``role`` (``take_usage(key)["by_role"]``: e.g. the graph-memory
pipeline's ``extract``, ``verify`` and ``reader`` (answer) calls; mem0's and MemAgent's ``manage``).

    hf       Hugging Face ``generate``: requests sorted by length, left-padded, ``batch_size`` per
             forward; greedy. Loads a model folder or a LoRA adapter folder through
             ``atommem_rl.models.load_policy`` (clear ``CheckpointError`` naming the path).
    vllm     ``vllm.LLM.chat`` on all requests at once (token counts from the engine's outputs).
    openai   an OpenAI-compatible ``/v1/chat/completions`` endpoint (``vllm serve``): one request per
             call, sent concurrently; token counts from the response's ``usage``.

``context_window`` is the model's maximum positions (or ``--context-tokens``); a prompt longer than
``context_window - max_new_tokens`` is cut from the left (its chat frame kept) and counted in
``usage[key]["cut_prompts"]`` -- methods build their contexts to fit, so a cut is a reported
anomaly, not a silent truncation.
"""

from __future__ import annotations

import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

USAGE_KEYS = ("calls", "prompt_tokens", "completion_tokens", "cut_prompts")
ROLE_KEYS = ("calls", "prompt_tokens", "completion_tokens")


@dataclass
class Request:
    messages: list[dict]
    max_new_tokens: int
    key: Any = None
    role: str = "reader"  # what the call is for (usage is split by it); a RoutedBackend also routes by it


def merge_roles(parts) -> dict[str, dict[str, int]]:
    """Sum several ``by_role`` dicts."""
    out: dict[str, dict[str, int]] = {}
    for part in parts:
        for role, u in part.items():
            o = out.setdefault(role, dict.fromkeys(ROLE_KEYS, 0))
            for k in ROLE_KEYS:
                o[k] += u.get(k, 0)
    return out


class Backend:
    name = "backend"

    def __init__(self, model_name: str, tokenizer, context_window: int):
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.context_window = int(context_window)
        self.usage: dict[Any, dict[str, int]] = defaultdict(lambda: dict.fromkeys(USAGE_KEYS, 0))
        self.role_usage: dict[Any, dict[str, dict[str, int]]] = defaultdict(dict)

    # ---------------------------------------------------------------- counting helpers
    def render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    def truncate(self, text: str, n: int, keep: str = "head") -> str:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= n:
            return text
        ids = ids[:n] if keep == "head" else ids[len(ids) - n:]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _account(self, key, prompt_tokens: int, completion_tokens: int, cut: bool = False, role: str = "reader") -> None:
        r = self.role_usage[key].setdefault(role, dict.fromkeys(ROLE_KEYS, 0))
        for u in (self.usage[key], r):
            u["calls"] += 1
            u["prompt_tokens"] += int(prompt_tokens)
            u["completion_tokens"] += int(completion_tokens)
        self.usage[key]["cut_prompts"] += int(cut)

    def take_usage(self, key) -> dict:
        """The task's counts (and pops them): ``USAGE_KEYS`` plus ``by_role`` {role: ``ROLE_KEYS``}."""
        out: dict = dict(self.usage.pop(key, dict.fromkeys(USAGE_KEYS, 0)))
        out["by_role"] = self.role_usage.pop(key, {})
        return out

    def generate(self, requests: list[Request]) -> list[str]:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        pass


class HFBackend(Backend):
    """Hugging Face ``generate`` (CPU or GPU), greedy, batched."""

    name = "hf"

    def __init__(self, model: Any = None, tokenizer: Any = None, *, batch_size: int = 8,
                 context_window: int | None = None, dtype: str | None = None):
        import torch

        if model is None or isinstance(model, (str, os.PathLike)):
            from atommem_rl.models import BASE_MODEL_DIR, load_policy, prepare_base_model

            path = model if model is not None else BASE_MODEL_DIR
            if model is None and not os.path.exists(os.path.join(path, "config.json")):
                prepare_base_model(path)
            model, tokenizer = load_policy(path, dtype=dtype)
            name = str(path)
        else:
            name = getattr(model.config, "_name_or_path", "model") or "model"
        model.eval()
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        window = context_window or getattr(model.config, "max_position_embeddings", None) or 2048
        super().__init__(name, tokenizer, window)
        self.model = model
        self.batch_size = batch_size
        self.device = next(model.parameters()).device
        self._torch = torch

    def generate(self, requests: list[Request]) -> list[str]:
        torch = self._torch
        tok = self.tokenizer
        outs: list[str] = [""] * len(requests)
        encoded = []
        for i, r in enumerate(requests):
            ids = tok.encode(self.render(r.messages), add_special_tokens=False)
            room = max(16, self.context_window - r.max_new_tokens)
            cut = len(ids) > room
            if cut:
                ids = ids[len(ids) - room:]
            encoded.append((i, ids, cut))
        encoded.sort(key=lambda e: len(e[1]))
        eos = set(tok.all_special_ids) if getattr(tok, "all_special_ids", None) else {tok.eos_token_id}
        eos_id = self.model.generation_config.eos_token_id or tok.eos_token_id
        for s in range(0, len(encoded), self.batch_size):
            part = encoded[s:s + self.batch_size]
            width = max(len(e[1]) for e in part)
            pad = tok.pad_token_id
            input_ids = torch.tensor([[pad] * (width - len(e[1])) + e[1] for e in part], device=self.device)
            mask = torch.tensor([[0] * (width - len(e[1])) + [1] * len(e[1]) for e in part], device=self.device)
            max_new = max(requests[e[0]].max_new_tokens for e in part)
            with torch.no_grad():
                gen = self.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new,
                                          do_sample=False, pad_token_id=pad, eos_token_id=eos_id)
            new = gen[:, width:].tolist()
            for (i, ids, cut), row in zip(part, new):
                row = row[: requests[i].max_new_tokens]
                n = len(row)
                for j, t in enumerate(row):
                    if t in eos:
                        n = j + 1
                        break
                outs[i] = tok.decode(row[:n], skip_special_tokens=True)
                self._account(requests[i].key, len(ids), n, cut, requests[i].role)
        return outs


class VLLMBackend(Backend):
    """``vllm.LLM.chat`` (optional dependency; imported only when chosen)."""

    name = "vllm"

    def __init__(self, model: str | None = None, *, context_window: int | None = None, **llm_kwargs):
        from transformers import AutoTokenizer
        from vllm import LLM

        from atommem_rl.models import BASE_MODEL_DIR, check_checkpoint

        from atommem_rl.policies.model import vllm_engine_kwargs

        path = str(check_checkpoint(model or BASE_MODEL_DIR))
        self.llm = LLM(model=path, max_model_len=context_window, **vllm_engine_kwargs(llm_kwargs))
        window = context_window or self.llm.llm_engine.model_config.max_model_len
        super().__init__(path, AutoTokenizer.from_pretrained(path), window)

    def generate(self, requests: list[Request]) -> list[str]:
        from vllm import SamplingParams

        params = [SamplingParams(max_tokens=r.max_new_tokens, temperature=0.0) for r in requests]
        outs = self.llm.chat([r.messages for r in requests], params, use_tqdm=False)
        texts = []
        for r, o in zip(requests, outs):
            self._account(r.key, len(o.prompt_token_ids or []), len(o.outputs[0].token_ids), role=r.role)
            texts.append(o.outputs[0].text)
        return texts


class OpenAIBackend(Backend):
    """An OpenAI-compatible chat endpoint; ``tokenizer`` (a path) is used to fit contexts."""

    name = "openai"

    def __init__(self, base_url: str, model_name: str, *, tokenizer: str | None = None,
                 context_window: int = 8192, concurrency: int = 16, timeout: float = 300.0):
        from transformers import AutoTokenizer

        from atommem_rl.models import BASE_MODEL_DIR, base_tokenizer

        if not base_url:
            raise ValueError("backend openai needs --base-url")
        tok = AutoTokenizer.from_pretrained(tokenizer) if tokenizer else (
            AutoTokenizer.from_pretrained(BASE_MODEL_DIR) if BASE_MODEL_DIR.exists() else base_tokenizer())
        super().__init__(model_name, tok, context_window)
        from atommem_rl.endpoints import chat_base_url

        self.base_url = base_url
        self.url = chat_base_url(base_url) + "/chat/completions"
        self.concurrency = concurrency
        self.timeout = timeout

    def _one(self, r: Request) -> str:
        from atommem_rl.endpoints import chat

        reply = chat(self.base_url, self.model_name, r.messages, max_tokens=r.max_new_tokens, temperature=0.0,
                     timeout=self.timeout)
        self._account(r.key, reply.prompt_tokens or self.count(self.render(r.messages)),
                      reply.completion_tokens or self.count(reply.text), role=r.role)
        return reply.text

    def generate(self, requests: list[Request]) -> list[str]:
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(requests))) as pool:
            return list(pool.map(self._one, requests))


class RoutedBackend(Backend):
    """Several models behind one backend: each request goes to the backend of its ``role`` (default:
    the reader), e.g. the graph-memory pipeline's extraction calls to a trained extractor and its
    verification and answers to the reader. Each role's requests stay one batched call; usage is the
    sum over all models. Counting and fitting contexts use the reader's tokenizer and window."""

    name = "routed"

    def __init__(self, reader: Backend, routes: dict[str, Backend]):
        super().__init__(reader.model_name, reader.tokenizer, reader.context_window)
        self.reader, self.routes = reader, dict(routes)
        self.name = "+".join([reader.name] + [f"{r}:{b.name}" for r, b in self.routes.items()])

    def generate(self, requests: list[Request]) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        by: dict[int, tuple[Backend, list[int]]] = {}
        for i, r in enumerate(requests):
            b = self.routes.get(r.role, self.reader)
            by.setdefault(id(b), (b, []))[1].append(i)
        for b, idx in by.values():
            for i, text in zip(idx, b.generate([requests[i] for i in idx])):
                out[i] = text
        return out

    def take_usage(self, key) -> dict:
        parts = [b.take_usage(key) for b in {id(b): b for b in [self.reader, *self.routes.values()]}.values()]
        out: dict = {k: sum(p.get(k, 0) for p in parts) for k in USAGE_KEYS}
        out["by_role"] = merge_roles(p.get("by_role") or {} for p in parts)
        return out

    def close(self) -> None:
        for b in self.routes.values():
            b.close()


def make_backend(kind: str = "hf", model: Any = None, *, base_url: str | None = None,
                 model_name: str | None = None, tokenizer: str | None = None, batch_size: int = 8,
                 context_window: int | None = None) -> Backend:
    if kind == "hf":
        return HFBackend(model, batch_size=batch_size, context_window=context_window)
    if kind == "vllm":
        return VLLMBackend(model, context_window=context_window)
    if kind == "openai":
        return OpenAIBackend(base_url, model_name or (str(model) if model else "default"),
                             tokenizer=tokenizer or (str(model) if model and os.path.isdir(str(model)) else None),
                             context_window=context_window or 8192)
    raise ValueError(f"unknown backend {kind!r}; expected hf, vllm or openai")
