"""The task format shared by every environment, generator and loader (one JSON object per line).

A task is a stream of *blocks* (documents, or dialogue sessions) made of *units* (sentences, or
dialogue turns), plus questions whose optional gold evidence names units, plus optional gold relation
labels between units. Units are the granularity of evidence recall and relation supervision. Gold
evidence is needed only by what measures or imitates it (the oracle's demonstrations, ``--max-blocks``
subsets and the ``evidence_bonus`` shaping, each of which says so); without it a task trains and
evaluates, with evidence recall reported as null. docs/OWN_DATA.md shows minimal tasks.

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

Every task read from a file goes through :meth:`Task.from_dict`: pydantic checks it against the
dataclasses' annotations below (strings are strict, ``role`` and ``kind`` are literals, answers are a
non-empty list and evidence a list of non-empty strings, units, questions and relations refuse unknown
keys), plus the per-task id checks (no duplicate unit or question id, evidence names units of the
task); the first error becomes one line naming the field (``questions[0].answers: expected a list,
got str 'Oslo'``). A file's loaders (:func:`iter_tasks`, ``tasks.load.load_dataset``) also refuse a task
id an earlier line used, and validate every line even when asked for the first N tasks only.
Dataclasses built in code are not re-checked beyond ``Task.__post_init__``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError, ValidationInfo
from pydantic import StrictStr, with_config

Role = Literal["evidence", "confounder", "distractor", "context"]
Kind = Literal["documents", "dialogue"]
ROLES, KINDS = get_args(Role), get_args(Kind)


# ------------------------------------------------------------------ field types (checked by pydantic in from_dict)
# A wrong type used to pass and fail later, far from the file ("answers": "Oslo" made the oracle answer
# "O"; an integer question id made every answer rejected), so strings are strict: no int, bool or null.
def _int_id(v: Any) -> Any:
    """Task and block ids may be JSON integers (some datasets number them); they become strings."""
    if isinstance(v, str):
        return v
    if type(v) is int:
        return str(v)
    raise ValueError(f"expected a string or an integer, got {type(v).__name__} {v!r:.60}")


def _seen(kind: str):
    """An id validator that refuses an id seen before in the same task (``info.context`` is one per task)."""
    def check(v: str, info: ValidationInfo) -> str:
        if info.context is not None:
            ids = info.context[kind]
            if v in ids:
                raise ValueError(f"duplicate {kind} id {v!r}")
            ids.add(v)
        return v
    return AfterValidator(check)


def _units_known(ids: list[str], info: ValidationInfo) -> list[str]:
    # evidence names units of this task (the blocks are validated first): an id that is none (a typo,
    # another task's) would make evidence recall and the evidence bonus silently 0 for the question
    for e in ids if info.context is not None else ():
        if e not in info.context["unit"]:
            raise ValueError(f"no unit has id {e!r}")
    return ids


def _at_least_one(what: str) -> AfterValidator:
    def check(items: list) -> list:
        if not items:
            raise ValueError(f"expected at least one {what}, got []")
        return items
    return AfterValidator(check)


Text = Annotated[StrictStr, Field(pattern=r"\S")]  # a non-empty string
Texts = Annotated[list[Text], _at_least_one("string")]
OptStr = StrictStr | None
IntId = Annotated[str, BeforeValidator(_int_id)]
# units, questions and relations refuse unknown keys; a left-out evidence list is checked like a given one
_FORBID = ConfigDict(extra="forbid", validate_default=True)


@with_config(_FORBID)
@dataclass
class Unit:
    id: Annotated[StrictStr, _seen("unit")]
    text: StrictStr
    role: Role = "context"
    speaker: OptStr = None
    fact: OptStr = None

    def statement(self) -> str:
        return self.fact or self.text


@dataclass
class Block:  # tasks and blocks may carry extra keys, which are ignored
    id: IntId
    units: list[Unit]
    title: OptStr = None
    date: OptStr = None


@with_config(_FORBID)
@dataclass
class Question:
    id: Annotated[StrictStr, _seen("question")]
    question: Text
    answers: Texts
    evidence: Annotated[list[Text], AfterValidator(_units_known)] = field(default_factory=list)  # optional
    category: Any = None
    date: OptStr = None


@with_config(_FORBID)
@dataclass
class GoldRelation:
    new: StrictStr
    old: StrictStr
    label: StrictStr


@dataclass
class Task:
    id: IntId
    kind: Kind
    blocks: list[Block]
    questions: Annotated[list[Question], _at_least_one("question")]
    source: StrictStr = "synthetic"
    relations: Annotated[list[GoldRelation], BeforeValidator(lambda v: [] if v is None else v)] = field(default_factory=list)
    meta: Annotated[dict[str, Any], BeforeValidator(lambda v: {} if v is None else v)] = field(default_factory=dict)

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

    def require_evidence(self, what: str) -> None:
        """Raise a one-line ValueError when a question has no gold evidence and ``what`` needs it."""
        missing = [q.id for q in self.questions if not q.evidence]
        if missing:
            raise ValueError(f"{what} needs gold evidence, and task {self.id!r} has none for question(s) "
                             f"{', '.join(missing[:5])} (docs/OWN_DATA.md)")

    def gold_labels(self) -> dict[tuple[str, str], str]:
        return {(r.new, r.old): r.label for r in self.relations}

    # ---------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> "Task":
        """The task, after pydantic checks ``d`` against the field types above; a ValueError names the
        first field that does not fit (``questions[1].answers: expected a list, got str 'Oslo'``)."""
        if isinstance(d, dict):  # what a task read from a file gets when it leaves these out
            d = {"kind": "documents", "source": "unknown", **d}
        try:
            return _adapter().validate_python(d, context={"unit": set(), "question": set()})
        except ValidationError as exc:
            raise ValueError(_first_error(exc)) from None


@functools.cache
def _adapter() -> TypeAdapter[Task]:
    return TypeAdapter(Task)


# pydantic's error types -> the words of the one-line error (ctx fills the braces)
_EXPECTED = {"string_type": "expected a string", "list_type": "expected a list", "dict_type": "expected a JSON object",
             "dataclass_type": "expected a JSON object", "string_pattern_mismatch": "expected a non-empty string",
             "literal_error": "expected {expected}"}


def _first_error(exc: ValidationError) -> str:
    """pydantic's first error as one line: the field path (``blocks[0].units[2].text``), what is wrong."""
    e = exc.errors()[0]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"]).lstrip(".") or "task"
    if e["type"] == "missing":
        what = "missing"
    elif e["type"] == "unexpected_keyword_argument":
        what = "unknown field"
    elif e["type"] == "value_error":  # one of the validators above
        what = str(e["ctx"]["error"])
    else:
        what = _EXPECTED[e["type"]].format(**e.get("ctx", {})) if e["type"] in _EXPECTED else e["msg"]
        what += f", got {type(e['input']).__name__} {e['input']!r:.60}"
    return f"{where}: {what}"


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
    """The tasks of a JSONL file, each validated (:meth:`Task.from_dict`) as it is read; a bad line, or a
    task id an earlier line already used, raises ``ValueError("FILE:LINE (task ID): field: what")``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"task file {path} does not exist")
    if not path.is_file():
        raise ValueError(f"task file {path} is a folder, expected a JSONL file")
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8", errors="strict") as fh:
        lineno = 0
        try:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    yield _task_at(json.loads(line), path, lineno, seen)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}:{lineno + 1}: not UTF-8 text: {exc}") from None


def check_new_id(task: Task, seen: dict[str, int], lineno: int) -> None:
    """Refuse a task id an earlier line of the file used (``seen``: id -> line, updated here): two tasks
    with one id would be run, scored and resumed as one."""
    if task.id in seen:
        raise ValueError(f"id: duplicate task id {task.id!r} (first on line {seen[task.id]})")
    seen[task.id] = lineno


def _task_at(raw: Any, path: Path, lineno: int, seen: dict[str, int]) -> Task:
    try:
        task = Task.from_dict(raw)
        check_new_id(task, seen, lineno)
        return task
    except ValueError as exc:
        tid = f" (task {raw['id']!r})" if isinstance(raw, dict) and "id" in raw else ""
        raise ValueError(f"{path}:{lineno}{tid}: {exc}") from None


def load_tasks(path: str | Path, limit: int | None = None) -> list[Task]:
    """The file's first ``limit`` tasks (all when None); every line is validated, also those past the
    limit (cheap next to any run), so a file is accepted or refused whatever the limit."""
    out = []
    for t in iter_tasks(path):
        if limit is None or len(out) < limit:
            out.append(t)
    return out
