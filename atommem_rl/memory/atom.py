"""The atom: one self-contained fact, its metadata, its role and its relations.

An atom is never rewritten by a relation (ROAM): relations only decide its *role*. ``update`` is
the one operation that changes text, and it keeps the previous text in ``history``.

Roles
    primary   active; returned by retrieval (as a fused view)
    evidence  supporting or outdated; reachable only through the Primary atom it backs
    deleted   removed from retrieval; kept for the episode's log

Relation labels (ROAM), read as "label(new, old)":
    independent           unrelated; nothing changes
    equivalent            same content; the new atom becomes evidence of the old one
    old_subsumed_by_new   the new atom is more general/complete; the old one becomes its evidence
    new_subsumed_by_old   the old atom already covers the new one; the new one becomes evidence
    conflict              the new atom supersedes the old one (a change over time); the old one
                          becomes outdated evidence of the new one
"""

from __future__ import annotations

import datetime as dt
import enum
import json
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidAtomError


class Role(str, enum.Enum):
    PRIMARY = "primary"
    EVIDENCE = "evidence"
    DELETED = "deleted"


class Relation(str, enum.Enum):
    INDEPENDENT = "independent"
    EQUIVALENT = "equivalent"
    OLD_SUBSUMED_BY_NEW = "old_subsumed_by_new"
    NEW_SUBSUMED_BY_OLD = "new_subsumed_by_old"
    CONFLICT = "conflict"

    @classmethod
    def parse(cls, label: "str | Relation") -> "Relation":
        """Accept the enum, its value, its name or ROAM's short code (IND, EQV, OSN, NSO, CON)."""
        if isinstance(label, Relation):
            return label
        if not isinstance(label, str):
            raise ValueError(f"relation label must be a string, got {type(label).__name__}")
        key = label.strip().lower().replace("-", "_").replace(" ", "_")
        for rel in cls:
            if key in (rel.value, rel.name.lower(), _SHORT[rel].lower()):
                return rel
        allowed = ", ".join(r.value for r in cls)
        raise ValueError(f"unknown relation label {label!r}; expected one of: {allowed}")

    @property
    def short(self) -> str:
        return _SHORT[self]


_SHORT = {
    Relation.INDEPENDENT: "IND",
    Relation.EQUIVALENT: "EQV",
    Relation.OLD_SUBSUMED_BY_NEW: "OSN",
    Relation.NEW_SUBSUMED_BY_OLD: "NSO",
    Relation.CONFLICT: "CON",
}

# ROAM's priority when one new atom carries several labels: CON > OSN > EQV > NSO > IND.
PRIORITY: dict[Relation, int] = {
    Relation.CONFLICT: 4,
    Relation.OLD_SUBSUMED_BY_NEW: 3,
    Relation.EQUIVALENT: 2,
    Relation.NEW_SUBSUMED_BY_OLD: 1,
    Relation.INDEPENDENT: 0,
}
# Labels whose winner keeps the new atom Primary and demotes the old one.
DEMOTES_OLD = frozenset({Relation.CONFLICT, Relation.OLD_SUBSUMED_BY_NEW})
# Labels whose winner makes the new atom evidence of the old one.
DEMOTES_NEW = frozenset({Relation.EQUIVALENT, Relation.NEW_SUBSUMED_BY_OLD})


_ISO_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")


def parse_day(value: Any) -> dt.date:
    """A calendar day from a date, a datetime, or an ISO string (``2023-05-08`` or a full timestamp)."""
    if isinstance(value, dt.datetime):
        return value.date()
    if isinstance(value, dt.date):
        return value
    if isinstance(value, str):
        # YYYY-MM-DD, or a whole ISO timestamp starting with it; anything after the date must parse too
        # ("2020-01-01 garbage" was read as 2020-01-01, and "1111111111" as a date in basic format)
        text = value.strip()
        try:
            if _ISO_DAY.fullmatch(text):
                return dt.date.fromisoformat(text)
            if _ISO_DAY.match(text[:10]) and text[10:11] in ("T", " "):
                return dt.datetime.fromisoformat(text).date()
        except ValueError:
            pass
    raise InvalidAtomError(f"time anchor must be an ISO date (YYYY-MM-DD) or a date, got {value!r}")


@dataclass(frozen=True)
class TimeSpan:
    """A closed interval of days; a single date is a span of one day."""

    start: dt.date
    end: dt.date

    @classmethod
    def parse(cls, value: Any) -> "TimeSpan | None":
        """``None``, a date, an ISO string, a ``(start, end)`` pair, or ``{"start":..,"end":..}``."""
        if value is None or isinstance(value, TimeSpan):
            return value
        if isinstance(value, dict):
            start, end = value.get("start"), value.get("end", value.get("start"))
        elif isinstance(value, (tuple, list)):
            if len(value) != 2:
                raise InvalidAtomError(f"a time range has two ends, got {value!r}")
            start, end = value
        else:
            start = end = value
        span = cls(parse_day(start), parse_day(end))
        if span.end < span.start:
            raise InvalidAtomError(f"time range ends before it starts: {value!r}")
        return span

    def overlaps(self, other: "TimeSpan") -> bool:
        return self.start <= other.end and other.start <= self.end

    def __str__(self) -> str:
        return self.start.isoformat() if self.start == self.end else f"{self.start}..{self.end}"


@dataclass
class HistoryEntry:
    """A previous version of an atom's text, and when it was replaced."""

    text: str
    replaced_at: int  # the store's logical clock (one tick per write)
    replaced_on: str | None = None  # the caller's time anchor for the change, ISO, if given

    def to_dict(self) -> dict:
        return {"text": self.text, "replaced_at": self.replaced_at, "replaced_on": self.replaced_on}


@dataclass
class Atom:
    id: str
    text: str
    participants: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    time: TimeSpan | None = None
    event_ids: tuple[str, ...] = ()
    source_ids: tuple[str, ...] = ()
    role: Role = Role.PRIMARY
    # outgoing relation labels: old atom id -> label (this atom is the "new" side)
    relations: dict[str, Relation] = field(default_factory=dict)
    history: list[HistoryEntry] = field(default_factory=list)
    created_at: int = 0
    updated_at: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)  # caller's extra scalar fields

    @property
    def active(self) -> bool:
        return self.role is not Role.DELETED

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "text": self.text,
            "participants": list(self.participants),
            "keywords": list(self.keywords),
            "time": None if self.time is None else [self.time.start.isoformat(), self.time.end.isoformat()],
            "event_ids": list(self.event_ids),
            "source_ids": list(self.source_ids),
            "role": self.role.value,
            "relations": {k: v.value for k, v in self.relations.items()},
            "history": [h.to_dict() for h in self.history],
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "metadata": dict(self.metadata),
        }


# --- Chroma metadata encoding ------------------------------------------------------------------
# Chroma stores flat metadata: str/int/float/bool/None scalars and non-empty same-type lists. The
# store's own fields use the "_am_" prefix so a caller's keys can never collide with them; relations
# and history are JSON strings because they are nested.
_P = "_am_"
RESERVED_PREFIX = _P


# the reserved key an atom can lose over its life: its relations, when a pair is relabelled the other
# way (the store never removes participants, keywords, events, sources, time or history). Only this
# one is sent as None: deleting list-valued keys the same way left Chroma 1.5.9's metadata index
# matching a later ``$contains`` filter on an atom without the key, in another collection (seen in
# tests/test_store.py::test_filters_by_participant_and_time run after tests/test_write_behind.py).
_OPTIONAL_KEYS = (_P + "relations",)


def to_chroma_metadata(atom: Atom, *, for_update: bool = False) -> dict[str, Any]:
    """The atom's Chroma metadata. ``for_update``: Chroma's ``update`` merges metadata (a key left out
    keeps its old value), so absent optional keys are sent as None, which deletes them; ``add`` and
    ``upsert`` of a new id refuse None values."""
    meta = _metadata(atom)
    if for_update:
        for key in _OPTIONAL_KEYS:
            meta.setdefault(key, None)
    return meta


def _metadata(atom: Atom) -> dict[str, Any]:
    meta: dict[str, Any] = dict(atom.metadata)
    meta[_P + "role"] = atom.role.value
    meta[_P + "created"] = atom.created_at
    meta[_P + "updated"] = atom.updated_at
    if atom.participants:
        meta[_P + "participants"] = list(atom.participants)
    if atom.keywords:
        meta[_P + "keywords"] = list(atom.keywords)
    if atom.event_ids:
        meta[_P + "events"] = list(atom.event_ids)
    if atom.source_ids:
        meta[_P + "sources"] = list(atom.source_ids)
    if atom.time is not None:
        # day ordinals make time-window filters plain integer comparisons inside Chroma
        meta[_P + "t0"] = atom.time.start.toordinal()
        meta[_P + "t1"] = atom.time.end.toordinal()
    if atom.relations:
        meta[_P + "relations"] = json.dumps({k: v.value for k, v in atom.relations.items()})
    if atom.history:
        meta[_P + "history"] = json.dumps([h.to_dict() for h in atom.history])
    return meta


def from_chroma(atom_id: str, document: str, meta: dict[str, Any]) -> Atom:
    meta = dict(meta or {})
    t0, t1 = meta.pop(_P + "t0", None), meta.pop(_P + "t1", None)
    relations = json.loads(meta.pop(_P + "relations", None) or "{}")
    history = json.loads(meta.pop(_P + "history", None) or "[]")
    atom = Atom(
        id=atom_id,
        text=document,
        participants=tuple(meta.pop(_P + "participants", None) or ()),
        keywords=tuple(meta.pop(_P + "keywords", None) or ()),
        time=None if t0 is None else TimeSpan(dt.date.fromordinal(t0), dt.date.fromordinal(t1)),
        event_ids=tuple(meta.pop(_P + "events", None) or ()),
        source_ids=tuple(meta.pop(_P + "sources", None) or ()),
        role=Role(meta.pop(_P + "role", Role.PRIMARY.value)),
        relations={k: Relation(v) for k, v in relations.items()},
        history=[HistoryEntry(**h) for h in history],
        created_at=int(meta.pop(_P + "created", 0)),
        updated_at=int(meta.pop(_P + "updated", 0)),
    )
    atom.metadata = {k: v for k, v in meta.items() if not k.startswith(_P)}
    return atom
