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
        if not isinstance(d, dict):
            raise ValueError(f"a task is a JSON object, got {type(d).__name__}")
        try:
            blocks = [
                Block(id=str(b["id"]), title=b.get("title"), date=b.get("date"),
                      units=[Unit(**u) for u in b["units"]])
                for b in d["blocks"]
            ]
            questions = [Question(**q) for q in d["questions"]]
            relations = [GoldRelation(**r) for r in d.get("relations") or []]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"task {d.get('id')!r} is malformed: {exc}") from None
        return cls(id=str(d["id"]), kind=d.get("kind", "documents"), blocks=blocks, questions=questions,
                   source=d.get("source", "unknown"), relations=relations, meta=dict(d.get("meta") or {}))


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
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                try:
                    yield Task.from_dict(json.loads(line))
                except (json.JSONDecodeError, ValueError) as exc:
                    raise ValueError(f"{path}:{lineno}: {exc}") from None


def load_tasks(path: str | Path, limit: int | None = None) -> list[Task]:
    out = []
    for t in iter_tasks(path):
        if limit is not None and len(out) >= limit:
            break
        out.append(t)
    return out
