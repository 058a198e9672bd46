"""The task format shared by every environment, generator and loader (one JSON object per line).

A task is a stream of *blocks* (documents, or dialogue sessions) made of *units* (sentences, or
dialogue turns), plus questions whose gold evidence names units, plus optional gold relation labels
between units. Units are the granularity of evidence recall and relation supervision.

    {"id": "synth-0-3", "kind": "documents" | "dialogue", "source": "synthetic" | "hotpotqa" | ...,
     "blocks": [{"id": "D1", "title": "...", "date": "2021-03-04",
                 "units": [{"id": "D1.s0", "text": "...", "role": "evidence" | "confounder" |
                            "distractor" | "context", "speaker": null, "fact": "..."}]}],
     "questions": [{"id": "Q1", "question": "...", "answers": ["..."], "evidence": ["D1.s0"],
                    "category": "...", "date": null}],
     "relations": [{"new": "D7.s1", "old": "D1.s0", "label": "conflict"}],
     "meta": {...}}

``fact`` is the unit as a self-contained statement built only from what the rendered block shows
(e.g. "Title: sentence", "Speaker (date): utterance"); the oracle stores it. ``role`` says whether a
unit is gold evidence for some question, a confounder (similar to evidence but about something else),
a distractor or plain context; environments use it for the confounder-token share.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("evidence", "confounder", "distractor", "context")
KINDS = ("documents", "dialogue")


@dataclass
class Unit:
    id: str
    text: str
    role: str = "context"
    speaker: str | None = None
    fact: str | None = None

    def statement(self) -> str:
        return self.fact or self.text


@dataclass
class Block:
    id: str
    units: list[Unit]
    title: str | None = None
    date: str | None = None


@dataclass
class Question:
    id: str
    question: str
    answers: list[str]
    evidence: list[str] = field(default_factory=list)
    category: Any = None
    date: str | None = None


@dataclass
class GoldRelation:
    new: str
    old: str
    label: str


@dataclass
class Task:
    id: str
    kind: str
    blocks: list[Block]
    questions: list[Question]
    source: str = "synthetic"
    relations: list[GoldRelation] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"task {self.id!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if not self.questions:
            raise ValueError(f"task {self.id!r} has no questions")
        ids = [u.id for b in self.blocks for u in b.units]
        if len(set(ids)) != len(ids):
            raise ValueError(f"task {self.id!r} has duplicate unit ids")

    # ---------------------------------------------------------------- lookups
    def units(self) -> dict[str, Unit]:
        return {u.id: u for b in self.blocks for u in b.units}

    def evidence_ids(self) -> set[str]:
        return {e for q in self.questions for e in q.evidence}

    def gold_labels(self) -> dict[tuple[str, str], str]:
        return {(r.new, r.old): r.label for r in self.relations}

    # ---------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Task":
        """The task, after checking ``d`` against the schema above; a ValueError names the first field
        that does not fit (``questions[1].answers: expected a list of strings, got str``)."""
        validate(d)
        blocks = [Block(id=str(b["id"]), title=b.get("title"), date=b.get("date"), units=[Unit(**u) for u in b["units"]])
                  for b in d["blocks"]]
        return cls(id=str(d["id"]), kind=d.get("kind", "documents"), blocks=blocks,
                   questions=[Question(**q) for q in d["questions"]], source=d.get("source", "unknown"),
                   relations=[GoldRelation(**r) for r in d.get("relations") or []], meta=dict(d.get("meta") or {}))


# ------------------------------------------------------------------ schema checks (before any work)
# field -> (accepted JSON types, required); a wrong type used to pass and fail later, far from the file
# ("answers": "Oslo" made the oracle answer "O"; an integer question id made every answer rejected)
_STR, _OPT_STR = (str,), (str, type(None))
_UNIT = {"id": (_STR, True), "text": (_STR, True), "role": (_STR, False), "speaker": (_OPT_STR, False),
         "fact": (_OPT_STR, False)}
_BLOCK = {"id": ((str, int), True), "units": ((list,), True), "title": (_OPT_STR, False), "date": (_OPT_STR, False)}
_QUESTION = {"id": (_STR, True), "question": (_STR, True), "answers": ((list,), True), "evidence": ((list,), False),
             "category": ((object,), False), "date": (_OPT_STR, False)}
_RELATION = {"new": (_STR, True), "old": (_STR, True), "label": (_STR, True)}
_TASK = {"id": ((str, int), True), "kind": (_STR, False), "source": (_STR, False), "blocks": ((list,), True),
         "questions": ((list,), True), "relations": ((list, type(None)), False), "meta": ((dict, type(None)), False)}


def _fields(obj: Any, spec: dict, where: str, strict: bool = True) -> None:
    """``strict``: unknown keys are errors (units, questions and relations always refused them; tasks and
    blocks may carry extra keys, which are ignored)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where or 'task'}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(spec))
    if unknown and strict:
        raise ValueError(f"{where or 'task'}: unknown field(s) {', '.join(map(repr, unknown))}")
    for key, (kinds, required) in spec.items():
        name = f"{where}.{key}" if where else key
        if key not in obj:
            if required:
                raise ValueError(f"{name}: missing")
            continue
        v = obj[key]
        if kinds != (object,) and (isinstance(v, bool) or not isinstance(v, kinds)):
            want = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise ValueError(f"{name}: expected {want}, got {type(v).__name__} {v!r:.60}")


def _strings(values: list, name: str, non_empty: bool) -> None:
    if non_empty and not values:
        raise ValueError(f"{name}: expected at least one string, got []")
    for i, v in enumerate(values):
        if not isinstance(v, str) or (non_empty and not v.strip()):
            raise ValueError(f"{name}[{i}]: expected a non-empty string, got {v!r:.60}")


def _unique(ids: list, what: str) -> None:
    seen = set()
    for i in ids:
        if i in seen:
            raise ValueError(f"duplicate {what} id {i!r}")
        seen.add(i)


def validate(d: Any) -> None:
    """Raise ValueError naming the field (``blocks[0].units[2].text``) unless ``d`` is a task."""
    _fields(d, _TASK, "", strict=False)
    if d.get("kind", "documents") not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {d['kind']!r}")
    units = []
    for bi, b in enumerate(d["blocks"]):
        _fields(b, _BLOCK, f"blocks[{bi}]", strict=False)
        for ui, u in enumerate(b["units"]):
            _fields(u, _UNIT, f"blocks[{bi}].units[{ui}]")
            if u.get("role", "context") not in ROLES:
                raise ValueError(f"blocks[{bi}].units[{ui}].role: expected one of {', '.join(ROLES)}, got {u['role']!r}")
            units.append(u["id"])
    _unique(units, "unit")
    unit_ids = set(units)
    if not d["questions"]:
        raise ValueError("questions: the task has none")
    for qi, q in enumerate(d["questions"]):
        _fields(q, _QUESTION, f"questions[{qi}]")
        if not q["question"].strip():
            raise ValueError(f"questions[{qi}].question: empty")
        _strings(q["answers"], f"questions[{qi}].answers", non_empty=True)
        _strings(q.get("evidence") or [], f"questions[{qi}].evidence", non_empty=True)
        # evidence names units of this task: an id that is none (a typo, another task's) would make
        # evidence recall and the evidence bonus silently 0 for the question
        unknown = [e for e in q.get("evidence") or [] if e not in unit_ids]
        if unknown:
            raise ValueError(f"questions[{qi}].evidence: no unit has id {unknown[0]!r}")
    _unique([q["id"] for q in d["questions"]], "question")
    for ri, r in enumerate(d.get("relations") or []):
        _fields(r, _RELATION, f"relations[{ri}]")


def save_tasks(tasks: Iterable[Task], path: str | Path) -> int:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as fh:
        for t in tasks:
            fh.write(json.dumps(t.to_dict(), ensure_ascii=False) + "\n")
            n += 1
    return n


def iter_tasks(path: str | Path) -> Iterator[Task]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"task file {path} does not exist")
    if not path.is_file():
        raise ValueError(f"task file {path} is a folder, expected a JSONL file")
    with path.open(encoding="utf-8", errors="strict") as fh:
        lineno = 0
        try:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    yield _task_at(json.loads(line), path, lineno)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}:{lineno + 1}: not UTF-8 text: {exc}") from None


def _task_at(raw: Any, path: Path, lineno: int) -> Task:
    try:
        return Task.from_dict(raw)
    except ValueError as exc:
        tid = f" (task {raw['id']!r})" if isinstance(raw, dict) and "id" in raw else ""
        raise ValueError(f"{path}:{lineno}{tid}: {exc}") from None


def load_tasks(path: str | Path, limit: int | None = None) -> list[Task]:
    out = []
    for t in iter_tasks(path):
        if limit is not None and len(out) >= limit:
            break
        out.append(t)
    return out
