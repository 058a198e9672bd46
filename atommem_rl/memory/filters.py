"""A read's filters (roles, participants, time window), as a Chroma ``where`` and on the mirror.

The store sends :func:`where_filter` with a filtered query and checks every hit again with
:func:`mirror_filter`: Chroma 1.5.9 can answer a ``$contains`` filter with an atom that lacks the key,
after a dropped collection whose atoms had the same ids
(tests/test_write_behind.py::test_filtered_read_ignores_a_dropped_namespaces_index).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .atom import RESERVED_PREFIX, Atom, Role, TimeSpan
from .validation import clean_strings


def where_filter(*, participants: Any = None, time_window: Any = None, include_evidence: bool = False) -> dict:
    """The Chroma ``where`` filter for a read (one top-level key, clauses joined with $and): Primary
    (and Evidence) atoms naming any of ``participants`` whose time anchor overlaps ``time_window``."""
    roles = [Role.PRIMARY.value, Role.EVIDENCE.value] if include_evidence else [Role.PRIMARY.value]
    clauses: list[dict] = [{RESERVED_PREFIX + "role": {"$in": roles}}]
    people = clean_strings(participants, "participants")
    if people:
        ors = [{RESERVED_PREFIX + "participants": {"$contains": p}} for p in people]
        clauses.append(ors[0] if len(ors) == 1 else {"$or": ors})
    span = TimeSpan.parse(time_window)
    if span is not None:
        clauses.append({RESERVED_PREFIX + "t0": {"$lte": span.end.toordinal()}})
        clauses.append({RESERVED_PREFIX + "t1": {"$gte": span.start.toordinal()}})
    return clauses[0] if len(clauses) == 1 else {"$and": clauses}


def mirror_filter(participants: Any, time_window: Any) -> Callable[[Atom], bool]:
    """The participant and time clauses of :func:`where_filter` as a test on an atom (atoms without a
    time anchor fail a time filter)."""
    people = set(clean_strings(participants, "participants"))
    span = TimeSpan.parse(time_window)

    def keep(atom: Atom) -> bool:
        if people and not people & set(atom.participants):
            return False
        return span is None or (atom.time is not None and atom.time.overlaps(span))

    return keep
