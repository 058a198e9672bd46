"""Chat completions on an OpenAI-compatible endpoint (``/v1/chat/completions``, e.g. ``vllm serve``), one
request per prompt, sent concurrently (at most ``concurrency`` at a time), through the one client
(:mod:`atommem_rl.inference.endpoints`: retries, timeouts, :class:`~atommem_rl.inference.endpoints.EndpointError`
naming the URL and what it was for).

The endpoint renders the chat messages itself, so prompts go as messages, not token ids. Counts come from
the response's ``usage``; where the endpoint reports none (or 0), they are counted with ``tokenizer`` over
the rendered prompt and the reply text, and are 0 without a tokenizer.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .generation import Completion, render_chat


class EndpointEngine:
    name = "openai"

    def __init__(self, base_url: str, model_name: str, *, tokenizer=None, concurrency: int = 16,
                 timeout: float = 300.0, what: str = "model endpoint"):
        self.base_url, self.model_name, self.tokenizer = base_url, model_name, tokenizer
        self.concurrency, self.timeout, self.what = int(concurrency), float(timeout), what

    def _count(self, text: str) -> int:
        if self.tokenizer is None or not text:
            return 0
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _one(self, messages: list[dict], max_new_tokens: int, temperature: float) -> Completion:
        from .endpoints import chat

        reply = chat(self.base_url, self.model_name, messages, max_tokens=int(max_new_tokens), temperature=temperature,
                     timeout=self.timeout, what=self.what)
        prompt = reply.prompt_tokens or (self._count(render_chat(self.tokenizer, messages)) if self.tokenizer else 0)
        completion = reply.completion_tokens or self._count(reply.text)
        return Completion(reply.text, int(prompt), int(completion))

    def generate(self, messages: list[list[dict]], max_new_tokens: int | list[int], *,
                 temperature: float = 0.0) -> list[Completion]:
        if not messages:
            return []
        limits = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(messages)
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(messages))) as pool:
            return list(pool.map(lambda a: self._one(a[0], a[1], temperature), zip(messages, limits)))

    def close(self) -> None:
        pass
