"""One reader/policy model behind one interface, with every call and token counted per task.

``Backend.generate(requests)`` takes :class:`Request` objects (chat messages, ``max_new_tokens``,
the key of the task they belong to) and returns one text per request, in order. Every request is
one LLM call: ``usage[key]`` accumulates ``calls``, ``prompt_tokens`` (the rendered chat prompt the
model actually read) and ``completion_tokens`` (generated tokens up to and including the end token),
and the same split by the request's ``role`` (``take_usage(key)["by_role"]``: e.g. the graph-memory
pipeline's ``extract``, ``verify`` and ``reader`` (answer) calls; mem0's and MemAgent's ``manage``).

Each backend is a thin user of one engine of the inference layer, which generates and counts:

    hf       Hugging Face ``generate`` (``hf_engine.py``): requests sorted by length, left-padded,
             ``batch_size`` per forward; greedy; a reply ends at any special token. Loads a model folder
             or a LoRA adapter folder through ``atommem_rl.models.load_policy`` (clear ``CheckpointError``
             naming the path).
    vllm     vLLM's offline engine (``vllm_engine.py``) on all requests at once, prompts as the same token
             ids HF generate gets (token counts from the engine's outputs).
    openai   an OpenAI-compatible ``/v1/chat/completions`` endpoint (``endpoint_engine.py``, e.g.
             ``vllm serve``): one request per call, sent concurrently; token counts from the response's
             ``usage`` (counted with the tokenizer where it reports none).

``context_window`` is the model's maximum positions (or ``--context-tokens``; vLLM: the engine's
``max_model_len``); for hf and vllm a prompt longer than ``context_window - max_new_tokens`` (at least 16)
keeps its last tokens and is counted in ``usage[key]["cut_prompts"]`` -- methods build their contexts to
fit, so a cut is a reported anomaly, not a silent truncation.

``make_backend(kind, model, ...)`` builds one (``atommem eval --backend``); :class:`RoutedBackend` puts
several behind one interface by request role.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from .endpoint_engine import EndpointEngine
from .endpoints import chat_base_url
from .generation import encode_chat, render_chat
from .hf_engine import HFEngine
from .vllm_engine import VLLMEngine

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
        return render_chat(self.tokenizer, messages)

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

    def _run(self, requests: list[Request], engine_generate) -> list[str]:
        """A local engine's call: every prompt tokenised here (cut to ``context_window - max_new_tokens``,
        at least 16 tokens kept), ``engine_generate(token ids)`` run once, each request counted."""
        encoded = [encode_chat(self.tokenizer, r.messages, max(16, self.context_window - r.max_new_tokens))
                   for r in requests]
        done = engine_generate([ids for ids, _ in encoded]) if requests else []
        for r, (_, cut), c in zip(requests, encoded, done):
            self._account(r.key, c.prompt_tokens, c.completion_tokens, cut, r.role)
        return [c.text for c in done]

    def close(self) -> None:
        pass


class HFBackend(Backend):
    """Hugging Face ``generate`` (CPU or GPU), greedy, ``batch_size`` requests per forward
    (:class:`~atommem_rl.inference.hf_engine.HFEngine`; a reply ends at any special token; ``autocast``:
    off, auto or bf16, as the engine's)."""

    name = "hf"

    def __init__(self, model: Any = None, tokenizer: Any = None, *, batch_size: int = 8,
                 context_window: int | None = None, dtype: str | None = None, autocast: str = "off"):
        if model is None or isinstance(model, (str, os.PathLike)):
            from atommem_rl.models import BASE_MODEL_DIR, load_policy, prepare_base_model

            path = model if model is not None else BASE_MODEL_DIR
            if model is None and not os.path.exists(os.path.join(path, "config.json")):
                prepare_base_model(path)
            model, tokenizer = load_policy(path, dtype=dtype)
            name = str(path)
        else:
            name = getattr(model.config, "_name_or_path", "model") or "model"
        self.engine = HFEngine(model, tokenizer, stop_at_special_tokens=True, autocast=autocast)
        window = context_window or getattr(model.config, "max_position_embeddings", None) or 2048
        super().__init__(name, tokenizer, window)
        self.model = model
        self.batch_size = batch_size
        self.device = self.engine.device

    def generate(self, requests: list[Request]) -> list[str]:
        return self._run(requests, lambda ids: self.engine.generate(
            ids, [r.max_new_tokens for r in requests], batch_size=self.batch_size))


class VLLMBackend(Backend):
    """vLLM's offline engine on all requests at once (:class:`~atommem_rl.inference.vllm_engine.VLLMEngine`;
    optional dependency, imported only when chosen)."""

    name = "vllm"

    def __init__(self, model: str | None = None, *, context_window: int | None = None, **llm_kwargs):
        from atommem_rl.models import BASE_MODEL_DIR

        self.engine = VLLMEngine(str(model or BASE_MODEL_DIR), max_model_len=context_window, **llm_kwargs)
        super().__init__(self.engine.path, self.engine.tokenizer, context_window or self.engine.max_model_len)

    def generate(self, requests: list[Request]) -> list[str]:
        return self._run(requests, lambda ids: self.engine.generate(ids, [r.max_new_tokens for r in requests]))

    def close(self) -> None:
        self.engine.close()


class OpenAIBackend(Backend):
    """An OpenAI-compatible chat endpoint (:class:`~atommem_rl.inference.endpoint_engine.EndpointEngine`);
    ``tokenizer`` (a path) is used to fit contexts and to count tokens where the endpoint reports none."""

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
        self.engine = EndpointEngine(base_url, model_name, tokenizer=tok, concurrency=concurrency, timeout=timeout)
        self.base_url = base_url
        self.url = chat_base_url(base_url) + "/chat/completions"
        self.concurrency = concurrency
        self.timeout = timeout

    def generate(self, requests: list[Request]) -> list[str]:
        if not requests:
            return []
        done = self.engine.generate([r.messages for r in requests], [r.max_new_tokens for r in requests])
        for r, c in zip(requests, done):
            self._account(r.key, c.prompt_tokens, c.completion_tokens, role=r.role)
        return [c.text for c in done]


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
                 context_window: int | None = None, autocast: str = "off") -> Backend:
    """A chat backend; ``autocast`` (off, auto, bf16) applies to Hugging Face generation only (vLLM and
    endpoints choose their own dtype)."""
    if kind == "hf":
        return HFBackend(model, batch_size=batch_size, context_window=context_window, autocast=autocast)
    if kind == "vllm":
        return VLLMBackend(model, context_window=context_window)
    if kind == "openai":
        return OpenAIBackend(base_url, model_name or (str(model) if model else "default"),
                             tokenizer=tokenizer or (str(model) if model and os.path.isdir(str(model)) else None),
                             context_window=context_window or 8192)
    raise ValueError(f"unknown backend {kind!r}; expected hf, vllm or openai")
