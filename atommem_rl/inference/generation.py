"""What every inference engine shares, so that HF generate, vLLM and an endpoint see the same prompt and report
the same counts.

* :func:`encode_chat` renders chat messages with the tokenizer's chat template (generation prompt added) and
  tokenises the text once, without adding special tokens again; with ``max_prompt_tokens`` a longer prompt is
  cut from the left and reported as cut (the caller counts it: a cut is an anomaly, never silent).
* :func:`cut_at_stop` keeps a generated row up to and including its first stop token: the completion
  tokens counted everywhere (padding after the end token is not a generated token).
* :class:`Completion` is what every engine returns per prompt: the text (special tokens skipped), the
  prompt and completion token counts and, for the local engines, the completion's token ids; vLLM also
  reports how many prompt tokens came from its prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int] = field(default_factory=list)  # empty for an endpoint (it returns text)
    cached_prompt_tokens: int | None = None  # prompt tokens read from vLLM's prefix cache (None: not reported)


def render_chat(tokenizer, messages: list[dict]) -> str:
    """The prompt text the model reads: the chat template with the assistant's generation prompt."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_chat(tokenizer, messages: list[dict], max_prompt_tokens: int | None = None) -> tuple[list[int], bool]:
    """(prompt token ids, whether they were cut to the last ``max_prompt_tokens``)."""
    ids = tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False)
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        return ids[len(ids) - max_prompt_tokens:], True
    return ids, False


def cut_at_stop(row: list[int], stops) -> list[int]:
    """``row`` up to and including the first token in ``stops`` (all of it when there is none)."""
    end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
    return row[:end]
