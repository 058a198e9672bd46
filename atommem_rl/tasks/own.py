"""A user's own JSONL of contexts, questions and answers -> tasks (``atommem data prepare --source jsonl``).

    atommem data prepare --source jsonl --path my.jsonl --out tasks/mine.jsonl \
        --context-field passages --question-field q --answer-field a [--id-field uid] [--title-field title]

One line of the user's file is one task. The field names are given on the command line (dotted paths
reach into nested objects: ``meta.question``). The context field holds

* a string: one document; or a list of strings: one document each (a ``documents`` task, sentences as
  units); or a list of ``{"title", "text"}`` objects (documents with titles);
* a list of chat turns ``{"role" or "speaker", "content" or "text"}``, or a list of such lists (sessions):
  a ``dialogue`` task, turns as units.

The question field holds one question or a list of them; the answer field one answer (a string, or a
list of accepted answers) or, with a list of questions, a list with one entry per question. No gold
evidence is made: such tasks train (GRPO, SFT from a teacher endpoint) and evaluate; what needs gold
evidence says so (docs/OWN_DATA.md). Every error names the line and the field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .schema import Block, Question, Task, Unit

_SENT = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")
_MISSING = object()


def _get(row: dict, path: str) -> Any:
    cur: Any = row
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


def _text(v: Any, where: str) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"{where}: expected a non-empty string, got {type(v).__name__} {v!r:.60}")
    return " ".join(v.split())


def _is_turn(v: Any) -> bool:
    return isinstance(v, dict) and any(k in v for k in ("role", "speaker")) and any(k in v for k in ("content", "text"))


def document_block(doc: Any, bid: str, where: str, date: str | None = None) -> Block:
    """One document (a string, or ``{"title", "text"}``) as a block of sentence units ``<bid>.s<i>``."""
    title = None
    if isinstance(doc, dict):
        title = doc.get("title")
        title = _text(title, f"{where}.title") if title is not None else None
        doc, where = doc.get("text", _MISSING), f"{where}.text"
    body = _text(doc, where)
    units = [Unit(id=f"{bid}.s{si}", text=s, fact=f"{title}: {s}" if title else s)
             for si, s in enumerate(x.strip() for x in _SENT.split(body) if x.strip())]
    return Block(id=bid, title=title, date=date, units=units)


def dialogue_block(turns: Any, bid: str, where: str, date: str | None = None) -> Block:
    """One session (a list of ``{role or speaker, content or text}`` turns) as a block of turn units."""
    if not isinstance(turns, list) or not turns or not all(_is_turn(t) for t in turns):
        raise ValueError(f"{where}: expected a list of turns {{role or speaker, content or text}}")
    units = []
    for ti, t in enumerate(turns):
        speaker = _text(t.get("speaker", t.get("role")), f"{where}[{ti}].speaker")
        text = _text(t.get("content", t.get("text")), f"{where}[{ti}].content")
        units.append(Unit(id=f"{bid}:{ti}", text=text, speaker=speaker, fact=f"{speaker}: {text}"))
    return Block(id=bid, date=date, units=units)


def is_chat(ctx: Any) -> bool:
    """Chat turns, or a list of sessions of them (a dialogue), rather than documents."""
    return isinstance(ctx, list) and bool(ctx) and (_is_turn(ctx[0]) or isinstance(ctx[0], list))


def _documents(ctx: Any, where: str) -> list[Block]:
    docs = [ctx] if isinstance(ctx, str) else ctx
    return [document_block(d, f"D{di + 1}", f"{where}[{di}]") for di, d in enumerate(docs)]


def _dialogue(ctx: list, where: str) -> list[Block]:
    sessions = [ctx] if _is_turn(ctx[0]) else ctx
    return [dialogue_block(turns, f"S{si + 1}", f"{where}[{si}]") for si, turns in enumerate(sessions)]


def _answers(v: Any, where: str) -> list[str]:
    vals = [v] if isinstance(v, str) else v
    if not isinstance(vals, list) or not vals:
        raise ValueError(f"{where}: expected a string or a non-empty list of strings, got {v!r:.60}")
    return [_text(a, f"{where}[{i}]") for i, a in enumerate(vals)]


def row_to_task(row: Any, n: int, fields: dict[str, str | None], source: str) -> Task:
    """One line's task; ``fields``: context, question, answer, id (optional) field paths."""
    where = f"line {n}"
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    got = {}
    for key in ("context", "question", "answer"):
        got[key] = _get(row, fields[key])
        if got[key] is _MISSING:
            raise ValueError(f"{where}: no field {fields[key]!r} (the --{key}-field); the line has "
                             f"{', '.join(sorted(row)) or 'no fields'}")
    ctx, cw = got["context"], f"{where}: {fields['context']}"
    if is_chat(ctx):
        kind, blocks = "dialogue", _dialogue(ctx, cw)
    elif isinstance(ctx, str) or (isinstance(ctx, list) and ctx):
        kind, blocks = "documents", _documents(ctx, cw)
    else:
        raise ValueError(f"{cw}: expected a string, a list of documents or a list of chat turns, got {ctx!r:.60}")
    qs, ans = got["question"], got["answer"]
    qw, aw = f"{where}: {fields['question']}", f"{where}: {fields['answer']}"
    if isinstance(qs, list):
        if not isinstance(ans, list) or len(ans) != len(qs) or not qs:
            raise ValueError(f"{aw}: with a list of {len(qs)} questions, expected a list of as many answers")
        questions = [Question(id=f"Q{i + 1}", question=_text(q, f"{qw}[{i}]"), answers=_answers(a, f"{aw}[{i}]"))
                     for i, (q, a) in enumerate(zip(qs, ans))]
    else:
        questions = [Question(id="Q1", question=_text(qs, qw), answers=_answers(ans, aw))]
    tid = _get(row, fields["id"]) if fields.get("id") else _MISSING
    tid = f"{source}-{n}" if tid is _MISSING else str(tid)
    # through from_dict: the same checks as a task read from a file (ids, types)
    return Task.from_dict(Task(id=tid, kind=kind, blocks=blocks, questions=questions, source=source,
                               meta={"line": n}).to_dict())


def prepare_jsonl(path, *, context_field: str = "context", question_field: str = "question",
                  answer_field: str = "answer", id_field: str | None = None, limit: int | None = None,
                  source: str = "own", **_) -> list[Task]:
    path = Path(path)
    fields = {"context": context_field, "question": question_field, "answer": answer_field, "id": id_field}
    tasks, seen = [], set()
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: line {n} is not JSON ({exc.msg})") from None
            try:
                task = row_to_task(row, n, fields, source)
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None
            if task.id in seen:
                raise ValueError(f"{path}: line {n}: task id {task.id!r} repeats an earlier line's")
            seen.add(task.id)
            tasks.append(task)
            if limit and len(tasks) >= limit:
                break
    if not tasks:
        raise ValueError(f"{path} holds no lines")
    return tasks
