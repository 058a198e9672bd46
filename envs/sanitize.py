"""Text cleaning for everything the environment shows or stores: shown text is data, so special-token strings
and tool-call tags are broken up (``defang``), data lines never start with the prompt's ``#`` headings
(``deheading``), lone surrogates are replaced (``clean_str``) and echoed values are shortened (``clip``)."""

from __future__ import annotations

import re
from typing import Any

# ChatML-style specials (<|im_end|>), and every tag-shaped word: tool-call tags and tokenizers' own
# tag-shaped specials (SmolLM2's <file_sep>, <repo_name>, ...), which would otherwise be encoded as
# special tokens. Ordinary markup in documents (<b>) only gains an invisible space.
_SPECIAL = re.compile(r"<\|[^|<>]{0,40}\|>|</?[A-Za-z_][A-Za-z0-9_]{0,40}>")


def defang(text: str) -> str:
    """Shown text is data: special-token strings and tool-call tags are broken up so they can neither
    change the chat structure nor look like a call (``<tool_call>`` -> ``<tool_call\u200b>``)."""
    if "<" not in text:
        return text
    return _SPECIAL.sub(lambda m: m.group(0)[:-1] + "\u200b>", text)


_HEADING = re.compile(r"^#", re.MULTILINE)


def deheading(text: str) -> str:
    """Lines of shown data never start with '#', so the prompt's '# Section' lines stay unambiguous."""
    return _HEADING.sub(" #", text) if "#" in text else text


def clean_str(value: str) -> str:
    """Lone surrogates cannot be encoded (Chroma, tokenizers): replace them."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        return value.encode("utf-8", "replace").decode("utf-8")


def clip(value: Any, n: int = 60) -> str:
    """A value as one short line for an error or result message (``...`` marks a cut)."""
    s = value if isinstance(value, str) else repr(value)
    s = clean_str(s).replace("\n", " ")
    return s if len(s) <= n else s[:n] + "..."
