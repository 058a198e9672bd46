"""What the store accepts from a caller, cleaned, or refused before anything is written.

A policy's output reaches the store unfiltered (the environments must never crash on it), so every
value is checked here and a bad one raises a :class:`~.errors.MemoryStoreError` subclass naming the
field: atom text (non-empty, under the length cap, no NUL), lists of strings (participants,
keywords, event and source ids: stripped, deduplicated in order), user metadata (what Chroma can
store, no reserved key), ids and namespaces. :class:`AtomDraft` is the caller's half of an atom and
:func:`draft_to_atom` the validated :class:`~.atom.Atom` made from it. Pure functions: the store,
events and profiles all validate through them.
"""

from __future__ import annotations

import re
import dataclasses
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import text as _text
from .atom import RESERVED_PREFIX, Atom, HistoryEntry, TimeSpan
from .errors import AtomNotFoundError, InvalidAtomError, InvalidMetadataError

NAMESPACE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,180}[A-Za-z0-9])?$")
ATOM_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
WRITER = re.compile(r"[0-9a-f]{4}")
AUTO_ID = re.compile(r"^a(\d+)(?:-[0-9a-f]{4})?$")  # a12-3f9c (and a12, written before writer tags)


@dataclass
class AtomDraft:
    """The fields a caller supplies for a new atom (everything else is derived)."""

    text: str
    participants: Sequence[str] = ()
    keywords: Sequence[str] | None = None  # None: extracted from the text
    time: Any = None  # date, ISO string, (start, end) or TimeSpan
    event_ids: Sequence[str] = ()
    source_ids: Sequence[str] = ()
    metadata: dict[str, Any] | None = None
    id: str | None = None  # None: the store assigns a1-<writer>, a2-<writer>, ... (see AtomStore)


def check_namespace(namespace: Any) -> str:
    if not isinstance(namespace, str) or not NAMESPACE.match(namespace):
        raise InvalidAtomError(
            f"namespace {namespace!r} must be 1-182 characters of [A-Za-z0-9._-], "
            "starting and ending with a letter or digit"
        )
    return namespace


def check_atom_id(atom_id: Any) -> str:
    """A caller-chosen id (the store's own ids are always valid)."""
    if not isinstance(atom_id, str) or not ATOM_ID.match(atom_id):
        raise InvalidAtomError(f"atom id {atom_id!r} must be 1-128 characters of [A-Za-z0-9_.:-]")
    return atom_id


def new_atom_id(requested: str | None, taken: Container[str], seen: Container[str], writer: str, seq: int,
                namespace: str) -> tuple[str, int]:
    """(id, next sequence number) for a new atom: the caller's ``requested`` id, checked and refused if
    ``taken`` (the namespace) or ``seen`` (earlier in the same call) holds it, or the next free
    ``a<seq>-<writer>``. Ids carry the writer's tag so two writers of one namespace never collide."""
    if requested is None:
        while f"a{seq}-{writer}" in taken or f"a{seq}-{writer}" in seen:
            seq += 1
        return f"a{seq}-{writer}", seq + 1
    aid = check_atom_id(requested)
    if aid in taken or aid in seen:
        raise InvalidAtomError(f"atom id {aid!r} already exists in namespace {namespace!r}")
    return aid, seq


def next_auto_seq(ids: Iterable[str]) -> int:
    """The first sequence number after every store-assigned id among ``ids`` (a reopened namespace)."""
    return 1 + max((int(m.group(1)) for m in map(AUTO_ID.match, ids) if m), default=0)


def live_atom(atoms: Mapping[str, Atom], atom_id: Any, namespace: str) -> Atom:
    """The atom ``atom_id`` names; AtomNotFoundError for a non-string, unknown or deleted id."""
    if not isinstance(atom_id, str):
        raise AtomNotFoundError(f"atom id must be a string, got {type(atom_id).__name__}")
    atom = atoms.get(atom_id)
    if atom is None:
        raise AtomNotFoundError(f"no atom {atom_id!r} in namespace {namespace!r}")
    if not atom.active:
        raise AtomNotFoundError(f"atom {atom_id!r} was deleted")
    return atom


def check_count(value: Any, name: str) -> int:
    """A non-negative int setting (``write_behind``, ``exact_below``): a programming error if not."""
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def check_query(query: Any, k: Any) -> None:
    if not isinstance(query, str) or not query.strip():
        raise InvalidAtomError("read query is empty or whitespace")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise InvalidAtomError(f"k must be a positive integer, got {k!r}")


def clean_text(text: Any, max_chars: int) -> str:
    """Atom text, stripped; refused when empty, over ``max_chars`` or holding a NUL."""
    if not isinstance(text, str):
        raise InvalidAtomError(f"atom text must be a string, got {type(text).__name__}")
    cleaned = text.strip()
    if not cleaned:
        raise InvalidAtomError("atom text is empty or whitespace")
    if len(cleaned) > max_chars:
        raise InvalidAtomError(
            f"atom text has {len(cleaned)} characters; the cap is {max_chars} "
            "(store an atomic fact, or split the text)"
        )
    if "\x00" in cleaned:
        raise InvalidAtomError("atom text contains a NUL character")
    return cleaned


def clean_strings(values: Any, what: str) -> tuple[str, ...]:
    """A string or list of strings, stripped and deduplicated in order (None: empty)."""
    if values is None:
        return ()
    if isinstance(values, str):
        values = [values]
    if not isinstance(values, (list, tuple)):
        raise InvalidAtomError(f"{what} must be a list of strings, got {type(values).__name__}")
    out: dict[str, None] = {}
    for v in values:
        if not isinstance(v, str) or not v.strip():
            raise InvalidAtomError(f"{what} must be non-empty strings, got {v!r}")
        out.setdefault(v.strip(), None)
    return tuple(out)


def clean_metadata(meta: Any) -> dict[str, Any]:
    """User metadata Chroma can store: scalar values or non-empty lists of one scalar type, string
    keys outside the store's reserved prefix."""
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise InvalidMetadataError(f"metadata must be a dict, got {type(meta).__name__}")
    out = {}
    for key, value in meta.items():
        if not isinstance(key, str) or not key:
            raise InvalidMetadataError(f"metadata keys must be non-empty strings, got {key!r}")
        if key.startswith(RESERVED_PREFIX):
            raise InvalidMetadataError(f"metadata key {key!r} uses the store's reserved prefix")
        if value is None or isinstance(value, (str, bool, int, float)):
            if isinstance(value, float) and not np.isfinite(value):
                raise InvalidMetadataError(f"metadata {key!r} is not a finite number: {value!r}")
            out[key] = value
            continue
        if isinstance(value, (list, tuple)):
            if not value:
                raise InvalidMetadataError(f"metadata {key!r} is an empty list; Chroma stores None instead")
            kinds = {type(v) for v in value}
            if len(kinds) != 1 or not kinds <= {str, int, float, bool}:
                raise InvalidMetadataError(
                    f"metadata {key!r} must be a list of one scalar type, got {sorted(k.__name__ for k in kinds)}"
                )
            out[key] = list(value)
            continue
        raise InvalidMetadataError(
            f"metadata {key!r} has a {type(value).__name__}; Chroma stores str, int, float, bool, None "
            "or non-empty lists of one of those"
        )
    return out


def clean_keywords(keywords: Any, text: str, keyword_limit: int) -> tuple[str, ...]:
    """The caller's keywords, or (None) those extracted from the cleaned ``text``."""
    return _text.keywords(text, keyword_limit) if keywords is None else clean_strings(keywords, "keywords")


def draft_to_atom(draft: AtomDraft, atom_id: str, clock: int, *, max_chars: int, keyword_limit: int) -> Atom:
    """The validated atom ``draft`` describes, created at logical time ``clock``."""
    text = clean_text(draft.text, max_chars)
    keywords = clean_keywords(draft.keywords, text, keyword_limit)
    return Atom(
        id=atom_id,
        text=text,
        participants=clean_strings(draft.participants, "participants"),
        keywords=keywords,
        time=TimeSpan.parse(draft.time),
        event_ids=clean_strings(draft.event_ids, "event_ids"),
        source_ids=clean_strings(draft.source_ids, "source_ids"),
        created_at=clock,
        updated_at=clock,
        metadata=clean_metadata(draft.metadata),
    )


def revised_atom(atom: Atom, text: Any, clock: int, *, time: Any, keywords: Any, max_chars: int,
                 keyword_limit: int) -> Atom:
    """``atom`` with new text (its previous text goes into its history, dated ``time`` when given)
    at logical time ``clock``; id, role and relations are kept."""
    new_text = clean_text(text, max_chars)
    span = TimeSpan.parse(time)
    kws = clean_keywords(keywords, new_text, keyword_limit)
    return dataclasses.replace(
        atom,
        text=new_text,
        keywords=kws,
        time=span if span is not None else atom.time,
        history=atom.history + [HistoryEntry(atom.text, clock, None if span is None else span.start.isoformat())],
        relations=dict(atom.relations),
        metadata=dict(atom.metadata),
        updated_at=clock,
    )
