"""Tool-call parsing: the policy's raw text -> tool calls (Qwen3 / Hermes format).

Format: any number of ``<tool_call>{"name": "...", "arguments": {...}}</tool_call>`` blocks; text
outside them is ignored, and so is everything inside ``<think>...</think>``. Each block is read with
``json.JSONDecoder.raw_decode`` starting right after the opening tag, so a tag-like string *inside* a
JSON string value (memory content that imitates tool-call syntax) is data, not a delimiter.

The parser never raises: a malformed block becomes a :class:`ParseError` with a message the policy can
act on, and parsing resumes at the next opening tag. ``arguments`` may also be a JSON string holding
an object (some models emit that). The parser is a replaceable component: an environment takes any
callable ``text -> (calls, errors)`` as its ``parser``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_DECODER = json.JSONDecoder()


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    index: int = 0  # position among the action's tool-call blocks


@dataclass
class ParseError:
    message: str
    index: int = 0


def _clip(text: str, n: int = 80) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= n else text[:n] + "..."


def parse_tool_calls(text: object, max_calls: int = 64) -> tuple[list[ToolCall], list[ParseError]]:
    """(calls, errors) in order of appearance; at most ``max_calls`` blocks are read."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not isinstance(text, str):
        return [], [ParseError(f"the action must be text, got {type(text).__name__}")]
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    pos, index = 0, 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            break
        # reasoning is skipped only where it starts outside a call: a "<think>" inside a JSON string is
        # data (stripping it first cut that call and every later one)
        think = text.find(THINK_OPEN, pos, start)
        if think >= 0:
            end = text.find(THINK_CLOSE, think)
            if end < 0:
                break  # unclosed reasoning runs to the end of the action
            pos = end + len(THINK_CLOSE)
            continue
        if index >= max_calls:
            errors.append(ParseError(f"more than {max_calls} tool calls in one action; the rest were ignored", index))
            break
        body_start = start + len(OPEN)
        i = body_start
        while i < len(text) and text[i].isspace():
            i += 1
        try:
            obj, end = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
            nxt = text.find(CLOSE, body_start)
            snippet = text[body_start: nxt if nxt >= 0 else body_start + 80]
            errors.append(ParseError(f"tool call {index + 1}: invalid JSON ({_clip(str(exc), 100)}) in {_clip(snippet)!r}", index))
            pos = nxt + len(CLOSE) if nxt >= 0 else len(text)
            index += 1
            continue
        j = end
        while j < len(text) and text[j].isspace():
            j += 1
        if text.startswith(CLOSE, j):
            pos = j + len(CLOSE)
        elif j >= len(text):
            pos = j  # an unclosed final block (generation stopped at the end of the JSON) is accepted
        else:
            errors.append(ParseError(f"tool call {index + 1}: expected {CLOSE} right after the JSON object", index))
            nxt = text.find(CLOSE, j)
            pos = nxt + len(CLOSE) if nxt >= 0 else len(text)
            index += 1
            continue
        call, err = _to_call(obj, index)
        if err:
            errors.append(err)
        else:
            calls.append(call)
        index += 1
    return calls, errors


def _to_call(obj: object, index: int) -> tuple[ToolCall | None, ParseError | None]:
    n = index + 1
    if not isinstance(obj, dict):
        return None, ParseError(f"tool call {n}: expected a JSON object with name and arguments, got {type(obj).__name__}", index)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, ParseError(f"tool call {n}: 'name' must be a non-empty string", index)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            return None, ParseError(f"tool call {n} ({_clip(name, 40)}): 'arguments' is a string that is not a JSON object", index)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None, ParseError(f"tool call {n} ({_clip(name, 40)}): 'arguments' must be an object, got {type(args).__name__}", index)
    return ToolCall(name=name, arguments=args, index=index), None


def format_tool_call(name: str, arguments: dict) -> str:
    """The canonical text of one call (what demonstrations and scripted policies emit)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"
