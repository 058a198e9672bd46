"""The policy's tools: their names and op counters, the JSON schemas shown in the system prompt
(Qwen3 function-calling format), and the checks a call passes before it runs: known and enabled tool,
argument names and types, length limits, and memory handles (M1, M2, ...) that name a live atom.
A refused call raises ``ToolError``, whose message goes into the next prompt."""

from __future__ import annotations

import re
from typing import Any

from atommem_rl.memory.atom import Relation

from .config import EnvConfig
from .parser import ToolCall
from .sanitize import clean_str, clip

OPS = ("create", "read", "update", "delete", "relate", "scratchpad", "answer")
TOOL_OP = {
    "create_memory": "create", "read_memory": "read", "update_memory": "update", "delete_memory": "delete",
    "label_relation": "relate", "write_scratchpad": "scratchpad", "answer": "answer",
}
_HANDLE = re.compile(r"^\s*\[?\s*[Mm]\s*(\d{1,9})\s*\]?\s*$")


class ToolError(Exception):
    """A tool call the environment refuses; the message goes into the next prompt."""


def _fn(name: str, desc: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": props, "required": required}}}


def tool_schemas(disable: tuple = (), answer: bool = True) -> list[dict]:
    """The schemas of the tools left after the ablations in ``disable`` (``answer``: with the answer tool)."""
    s = {"type": "string"}
    out = []
    if "store" not in disable:
        out.append(_fn("create_memory", "Store one atomic, self-contained fact.",
                       {"content": {**s, "description": "the fact"},
                        "time": {**s, "description": "optional date of the fact, YYYY-MM-DD"}}, ["content"]))
        out.append(_fn("read_memory", "Retrieve the memories that best match a query; shown in the next prompt.",
                       {"query": s}, ["query"]))
        if "update" not in disable:
            out.append(_fn("update_memory", "Replace the text of a memory (the old text is kept as history).",
                           {"id": {**s, "description": "handle, e.g. M3"}, "content": s}, ["id", "content"]))
        if "delete" not in disable:
            out.append(_fn("delete_memory", "Remove a memory.", {"id": {**s, "description": "handle, e.g. M3"}}, ["id"]))
        if "relations" not in disable:
            out.append(_fn("label_relation", "Label how a newer memory relates to an older one.",
                           {"new": {**s, "description": "handle of the newer memory"},
                            "old": {**s, "description": "handle of the older memory"},
                            "label": {"type": "string", "enum": [r.value for r in Relation]}},
                           ["new", "old", "label"]))
    if "scratchpad" not in disable:
        out.append(_fn("write_scratchpad", "Rewrite your scratchpad (replaces it; keep it short).", {"content": s}, ["content"]))
    if answer:
        out.append(_fn("answer", "Answer a question (answer phase only).",
                       {"question_id": {**s, "description": "e.g. Q1"}, "answer": s}, ["question_id", "answer"]))
    return out


ARG_TYPES = {
    "create_memory": {"content": str, "time": str},
    "read_memory": {"query": str},
    "update_memory": {"id": str, "content": str},
    "delete_memory": {"id": str},
    "label_relation": {"new": str, "old": str, "label": str},
    "write_scratchpad": {"content": str},
    "answer": {"question_id": str, "answer": str},
}
OPTIONAL = {"create_memory": {"time"}, "answer": {"question_id"}}


def check_args(call: ToolCall, config: EnvConfig, tool_names: list[str]) -> dict:
    """The call's arguments, checked and cleaned, or ``ToolError`` saying what is wrong."""
    name = call.name
    if name not in ARG_TYPES:
        raise ToolError(f"unknown tool {clip(name, 40)!r}; available: {', '.join(tool_names)}")
    op = TOOL_OP[name]
    disabled = (
        (op in ("create", "read", "update", "delete", "relate") and "store" in config.disable)
        or (op == "update" and "update" in config.disable)
        or (op == "delete" and "delete" in config.disable)
        or (op == "relate" and "relations" in config.disable)
        or (op == "scratchpad" and "scratchpad" in config.disable)
    )
    if disabled:
        raise ToolError(f"tool {name} is disabled in this environment")
    spec = ARG_TYPES[name]
    args = call.arguments
    extra = set(args) - set(spec)
    if extra:
        raise ToolError(f"{name}: unexpected argument(s) {', '.join(clip(k, 30) for k in sorted(map(str, extra)))}")
    out = {}
    for key, typ in spec.items():
        if key not in args or args[key] is None:
            if key in OPTIONAL.get(name, ()):
                continue
            raise ToolError(f"{name}: missing required argument {key!r}")
        val = args[key]
        if not isinstance(val, typ) or isinstance(val, bool):
            raise ToolError(f"{name}: argument {key!r} must be a {typ.__name__}, got {type(val).__name__}")
        val = clean_str(val)
        limit = config.max_atom_chars if key == "content" else config.max_arg_chars
        if len(val) > limit:
            raise ToolError(f"{name}: argument {key!r} has {len(val)} characters; the limit is {limit}")
        if "\x00" in val:
            raise ToolError(f"{name}: argument {key!r} contains a NUL character")
        out[key] = val
    return out


def resolve_handle(value: Any, handles: dict[str, str], store, what: str = "id") -> str:
    """The atom id behind a handle the policy wrote ("M3", "[m3]", ...), or ``ToolError`` when it is not a
    handle, names no atom of this episode, or names a deleted one."""
    if not isinstance(value, str):
        raise ToolError(f"{what} must be a memory handle like M3, got {type(value).__name__}")
    m = _HANDLE.match(value)
    if not m or f"M{int(m.group(1))}" not in handles:
        raise ToolError(f"unknown memory {clip(value, 40)!r}: use a handle shown as [M1], [M2], ...")
    aid = handles[f"M{int(m.group(1))}"]
    if store is None or aid not in store:
        raise ToolError(f"memory {clip(value, 40)} was deleted")
    return aid


def new_handle(handles: dict[str, str], handle_of: dict[str, str], atom_id: str) -> str:
    """Give a new atom the next handle (M1, M2, ...; never reused) and record it both ways."""
    handle = f"M{len(handles) + 1}"
    handles[handle] = atom_id
    handle_of[atom_id] = handle
    return handle
