"""Event records: what one event of the event layer (``memory/events.py``) holds, and its Chroma form.

:class:`Event` is ``(id, summary, atom_ids, participants, keywords, time span)`` plus ``closed``,
``summary_by`` and ``seq`` (creation order); ``_to_meta`` / ``_from_meta`` turn it into the metadata of
its record in the ``atommem-<namespace>.events`` collection and back (lists omitted when empty: Chroma
rejects empty lists; the time span as day ordinals ``t0``/``t1``, omitted when unknown). :class:`Placement`
and :class:`EventHit` are what placement and search return; :func:`_hull` is the time span of a
merged membership. Pure data: no store, no Chroma calls.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from .atom import TimeSpan
from .errors import AtomNotFoundError


class EventNotFoundError(AtomNotFoundError):
    """The event id is unknown in this namespace (a :class:`AtomNotFoundError`, so callers that
    catch the store's errors catch it too)."""


@dataclass(frozen=True)
class Event:
    id: str
    summary: str
    atom_ids: tuple[str, ...] = ()
    participants: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    time: TimeSpan | None = None
    closed: bool = False
    summary_by: str = "extractive"  # extractive | caller
    seq: int = 0  # creation order

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "summary": self.summary,
            "atom_ids": list(self.atom_ids),
            "participants": list(self.participants),
            "keywords": list(self.keywords),
            "time": None if self.time is None else [self.time.start.isoformat(), self.time.end.isoformat()],
            "closed": self.closed,
            "summary_by": self.summary_by,
        }


@dataclass(frozen=True)
class Placement:
    """Where ``place`` would put an atom: an existing event (``new`` False) or a new one."""

    event_id: str
    new: bool
    score: float  # hybrid similarity to the chosen event; 0.0 for a new one; 1.0 when the atom named it


@dataclass(frozen=True)
class EventHit:
    event: Event
    score: float  # cosine similarity of the query to the summary


def _to_meta(ev: Event) -> dict[str, Any]:
    meta: dict[str, Any] = {"seq": ev.seq, "closed": ev.closed, "summary_by": ev.summary_by}
    if ev.atom_ids:
        meta["atoms"] = list(ev.atom_ids)
    if ev.participants:
        meta["participants"] = list(ev.participants)
    if ev.keywords:
        meta["keywords"] = list(ev.keywords)
    if ev.time is not None:
        meta["t0"] = ev.time.start.toordinal()
        meta["t1"] = ev.time.end.toordinal()
    return meta


def _from_meta(eid: str, doc: str, meta: dict[str, Any] | None) -> Event:
    meta = meta or {}
    t0, t1 = meta.get("t0"), meta.get("t1")
    return Event(
        id=eid,
        summary=doc or "",
        atom_ids=tuple(meta.get("atoms") or ()),
        participants=tuple(meta.get("participants") or ()),
        keywords=tuple(meta.get("keywords") or ()),
        time=None if t0 is None else TimeSpan(dt.date.fromordinal(int(t0)), dt.date.fromordinal(int(t1))),
        closed=bool(meta.get("closed", False)),
        summary_by=str(meta.get("summary_by", "extractive")),
        seq=int(meta.get("seq", 0)),
    )



def _hull(a: TimeSpan | None, b: TimeSpan | None) -> TimeSpan | None:
    if a is None or b is None:
        return a or b
    return TimeSpan(min(a.start, b.start), max(a.end, b.end))

