"""The one client for OpenAI-compatible HTTP endpoints: the policy's and the evaluation's chat models, the
LLM judge and the embedding endpoint all call through here.

It is the ``openai`` SDK's client, so every endpoint gets the same timeouts, the same retries (connection
errors, timeouts, 408/409/429 and 5xx, with exponential backoff and the server's ``retry-after``) and the same
token accounting (the response's ``usage``). A call that still fails raises :class:`EndpointError`, a
``ConnectionError`` naming the endpoint and what it was for; callers decide what that means (the environment
scores a failed judge call 0 and reports it, a policy call fails its episode, the embedder raises
``StoreUnavailableError``).

    from atommem_rl.inference.endpoints import chat, embed
    reply = chat("http://127.0.0.1:8000", "model", [{"role": "user", "content": "hi"}], max_tokens=8)
    reply.text, reply.prompt_tokens, reply.completion_tokens
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

MAX_RETRIES = 3  # after the first attempt: 4 in all, about 0.5 + 1 + 2 s of backoff (the SDK's schedule)

_clients: dict[tuple, object] = {}
_lock = threading.Lock()


class EndpointError(ConnectionError):
    """An endpoint call failed after its retries."""


@dataclass
class Reply:
    text: str
    prompt_tokens: int | None  # None: the endpoint reported no usage
    completion_tokens: int | None


def chat_base_url(url: str) -> str:
    """The SDK's base URL for a chat endpoint given as ``http://host:port`` or ``.../v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def client(base_url: str, *, api_key_env: str = "OPENAI_API_KEY", timeout: float = 300.0,
           max_retries: int = MAX_RETRIES):
    """A cached ``openai.OpenAI`` for these settings (thread-safe: one connection pool per endpoint)."""
    import openai

    key = (base_url, os.environ.get(api_key_env) or "EMPTY", float(timeout), int(max_retries))
    with _lock:
        if key not in _clients:
            _clients[key] = openai.OpenAI(base_url=key[0], api_key=key[1], timeout=key[2], max_retries=key[3])
        return _clients[key]


def chat(base_url: str, model: str, messages: list[dict], *, max_tokens: int, temperature: float = 0.0,
         timeout: float = 300.0, api_key_env: str = "OPENAI_API_KEY", max_retries: int = MAX_RETRIES,
         what: str = "model endpoint") -> Reply:
    """One chat completion. ``what`` names the endpoint's role in the error."""
    import openai

    url = chat_base_url(base_url)
    try:
        resp = client(url, api_key_env=api_key_env, timeout=timeout, max_retries=max_retries).chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=temperature)
        text = resp.choices[0].message.content or ""
    except (openai.OpenAIError, IndexError, AttributeError, TypeError) as exc:  # transport, status, malformed body
        raise EndpointError(f"{what} {url}/chat/completions failed: {type(exc).__name__}: {exc}") from exc
    usage = resp.usage
    return Reply(text, getattr(usage, "prompt_tokens", None), getattr(usage, "completion_tokens", None))


def embed(base_url: str, model: str, inputs: list[str], *, timeout: float = 60.0, api_key_env: str = "OPENAI_API_KEY",
          max_retries: int = MAX_RETRIES, what: str = "embedding endpoint") -> list[list[float]]:
    """Embeddings of ``inputs`` in input order. ``base_url`` is used as given (``.../v1`` for most servers)."""
    import openai

    url = base_url.rstrip("/")
    try:
        resp = client(url, api_key_env=api_key_env, timeout=timeout, max_retries=max_retries).embeddings.create(
            model=model, input=inputs, encoding_format="float")
        rows = [d.embedding for d in sorted(resp.data, key=lambda d: d.index)]
    except (openai.OpenAIError, AttributeError, TypeError) as exc:
        raise EndpointError(f"{what} {url}/embeddings failed: {type(exc).__name__}: {exc}") from exc
    if len(rows) != len(inputs):
        raise EndpointError(f"{what} {url}/embeddings returned {len(rows)} vectors for {len(inputs)} inputs")
    return rows
