"""Temporal profiles: stable attributes of each participant, versioned, updated once per session.

Storage. One Chroma collection per namespace, ``atommem-<namespace>.profiles``, in the store's
client, with one record per (participant, attribute): the document is ``"<participant>
<attribute>: <value>"`` (embedded with the store's embedder), the metadata holds ``participant``,
``attribute``, ``value``, ``kind``, ``since`` and ``last_seen`` (ISO days), ``sources`` (list,
omitted when empty) and ``history``, the older versions as a JSON string
``[{"value", "since", "until", "sources", "kind"}, ...]`` in time order. A new process rebuilds
the layer from the collection.

Keys and comparison. Participants match case-insensitively after collapsing whitespace (the first
spelling seen is kept for display). Attributes and values are compared in a normalised form:
Unicode NFKC, case-folded, every run of punctuation/underscores turned into one space, whitespace
collapsed ("Favorite_Food" == "favorite food"; "Sushi!" == "sushi"). The attribute is stored in
that form; a value keeps the caller's spelling (stripped) for display.

Queue, then flush. During a session :meth:`ProfileLayer.queue` validates a candidate
``(participant, attribute, value, time, source_ids, kind)`` (kind: trait, preference or history)
and appends it; nothing is written. :meth:`ProfileLayer.flush` at session end takes the queue in
time order (a candidate without a time gets the session time; ties keep queue order), and
decides each candidate against the state left by the previous ones (``t`` its time):

    create          no record for (participant, attribute): value since ``t``.
    redundant       the value equals the current value: only its sources (union) and
                    ``last_seen = max(last_seen, t)`` change. A candidate about the past whose value
                    equals the history version in force at ``t`` is also redundant (the sources join
                    that version).
    revise_history  ``t`` is earlier than the current value's ``since`` and the value differs: a
                    version ``[t, next start)`` is inserted into the history in time order; the
                    version in force at ``t`` (if any) now ends at ``t``; the current value is
                    untouched.
    update          otherwise (``t >= since``, a different value): the current version moves to the
                    history with ``until = t`` and the candidate becomes the current value since
                    ``t`` (a same-day change keeps the replaced version, as a zero-length one).
                    Old versions are never deleted.

The changed records are written with one ``upsert`` (in Chroma-sized chunks beyond the batch limit,
with the earlier chunks restored if a later one fails); the mirror and the queue change only after
Chroma acknowledged, so a failed flush leaves the stored profiles and the queue as they were.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import hashlib
import json
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .atom import parse_day
from .embeddings import Embedder
from .errors import AtomNotFoundError, InvalidAtomError, MemoryStoreError
from .store import COLLECTION_PREFIX, AtomStore
from .validation import clean_strings

PROFILES_SUFFIX = ".profiles"
KINDS = ("trait", "preference", "history")
DECISIONS = ("redundant", "update", "revise_history", "create")
MAX_ATTRIBUTE_CHARS = 120

_PUNCT = re.compile(r"[\W_]+", re.UNICODE)


class UnknownParticipantError(AtomNotFoundError):
    """The participant has no profile and is not on the layer's roster (an AtomNotFoundError, so
    callers that catch the store's errors catch it too)."""


def normalise(text: str) -> str:
    """The comparison form of an attribute or value (see the module docstring)."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return " ".join(_PUNCT.sub(" ", text).split())


def _pkey(participant: str) -> str:
    return " ".join(participant.split()).casefold()


@dataclass(frozen=True)
class ProfileCandidate:
    participant: str
    attribute: str  # normalised
    value: str  # the caller's spelling, stripped
    time: dt.date | None = None
    source_ids: tuple[str, ...] = ()
    kind: str = "trait"


@dataclass
class Version:
    value: str
    since: dt.date
    until: dt.date | None  # None: still current
    sources: list[str] = field(default_factory=list)
    kind: str = "trait"

    def to_dict(self) -> dict:
        return {"value": self.value, "since": self.since.isoformat(),
                "until": None if self.until is None else self.until.isoformat(),
                "sources": list(self.sources), "kind": self.kind}

    @classmethod
    def from_dict(cls, d: dict) -> "Version":
        return cls(d["value"], dt.date.fromisoformat(d["since"]),
                   None if d.get("until") is None else dt.date.fromisoformat(d["until"]),
                   list(d.get("sources") or ()), d.get("kind", "trait"))


@dataclass
class ProfileRecord:
    participant: str
    attribute: str
    current: Version
    last_seen: dt.date
    history: list[Version] = field(default_factory=list)  # older versions, ordered by since

    @property
    def id(self) -> str:
        # a hash: participant and attribute are free text, ids should be short and safe
        key = _pkey(self.participant) + "\x00" + self.attribute
        return "prof-" + hashlib.sha1(key.encode("utf-8")).hexdigest()[:20]

    @property
    def document(self) -> str:
        return f"{self.participant} {self.attribute}: {self.current.value}"

    def metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "participant": self.participant, "attribute": self.attribute, "value": self.current.value,
            "kind": self.current.kind, "since": self.current.since.isoformat(),
            "last_seen": self.last_seen.isoformat(),
            "history": json.dumps([v.to_dict() for v in self.history]),
        }
        if self.current.sources:  # Chroma rejects empty lists
            meta["sources"] = list(self.current.sources)
        return meta

    @classmethod
    def from_chroma(cls, meta: dict[str, Any]) -> "ProfileRecord":
        current = Version(meta["value"], dt.date.fromisoformat(meta["since"]), None,
                          list(meta.get("sources") or ()), meta.get("kind", "trait"))
        return cls(meta["participant"], meta["attribute"], current, dt.date.fromisoformat(meta["last_seen"]),
                   [Version.from_dict(d) for d in json.loads(meta.get("history") or "[]")])

    def to_dict(self) -> dict:
        return {"value": self.current.value, "since": self.current.since.isoformat(),
                "kind": self.current.kind, "sources": list(self.current.sources),
                "last_seen": self.last_seen.isoformat(), "history": [v.to_dict() for v in self.history]}


@dataclass
class FlushReport:
    session_time: dt.date
    counts: dict[str, int]  # decision -> number of candidates (every decision present)
    decisions: list[tuple[ProfileCandidate, str]]  # in the order they were applied

    @property
    def total(self) -> int:
        return len(self.decisions)


class ProfileLayer:
    """Profiles of one store's namespace. See the module docstring for the algorithm.

    ``participants``: an optional roster; when given, candidates for anyone else are refused with
    UnknownParticipantError. Without it every non-empty name is accepted.
    """

    def __init__(self, store: AtomStore, *, participants: Iterable[str] | None = None,
                 embedder: Embedder | None = None):
        self.store = store
        self.embedder = embedder if embedder is not None else store.embedder
        self.name = COLLECTION_PREFIX + store.namespace + PROFILES_SUFFIX
        self.collection = store._chroma(
            "opening the profile collection", store.client.get_or_create_collection,
            name=self.name, embedding_function=self.embedder, configuration={"hnsw": {"space": "cosine"}},
        )
        self.batch_size = store.batch_size
        self._records: dict[tuple[str, str], ProfileRecord] = {}  # (participant key, attribute)
        self._queue: list[ProfileCandidate] = []
        self.roster: dict[str, str] | None = None  # participant key -> display name
        if participants is not None:
            self.roster = {}
            for p in participants:
                if not isinstance(p, str) or not p.strip():
                    raise InvalidAtomError(f"roster names must be non-empty strings, got {p!r}")
                self.roster.setdefault(_pkey(p), " ".join(p.split()))
        self._load()

    def _load(self) -> None:
        offset = 0
        while True:
            page = self.store._chroma("loading profiles", self.collection.get, include=["metadatas"],
                                      limit=self.batch_size, offset=offset)
            for meta in page["metadatas"]:
                rec = ProfileRecord.from_chroma(meta)
                self._records[(_pkey(rec.participant), rec.attribute)] = rec
            if len(page["ids"]) < self.batch_size:
                break
            offset += self.batch_size

    # ------------------------------------------------------------------ validation
    def _clean_participant(self, participant: Any) -> str:
        if not isinstance(participant, str) or not participant.strip():
            raise InvalidAtomError(f"participant must be a non-empty string, got {participant!r}")
        name = " ".join(participant.split())
        if self.roster is not None:
            if _pkey(name) not in self.roster:
                raise UnknownParticipantError(
                    f"participant {name!r} is not on the roster of namespace {self.store.namespace!r}: "
                    f"{sorted(self.roster.values())}"
                )
            return self.roster[_pkey(name)]
        return self._display(name)

    def _display(self, name: str) -> str:
        """The first spelling seen for this participant (roster, then stored records)."""
        key = _pkey(name)
        if self.roster and key in self.roster:
            return self.roster[key]
        for (pk, _), rec in self._records.items():
            if pk == key:
                return rec.participant
        for c in self._queue:
            if _pkey(c.participant) == key:
                return c.participant
        return name

    def candidate(self, participant: str, attribute: str, value: str, *, time: Any = None,
                  source_ids: Sequence[str] = (), kind: str = "trait") -> ProfileCandidate:
        """A validated candidate (not queued). Raises InvalidAtomError or UnknownParticipantError."""
        name = self._clean_participant(participant)
        if not isinstance(attribute, str) or not normalise(attribute):
            raise InvalidAtomError(f"profile attribute must be a non-empty string, got {attribute!r}")
        attr = normalise(attribute)
        if len(attr) > MAX_ATTRIBUTE_CHARS:
            raise InvalidAtomError(f"profile attribute has {len(attr)} characters; the cap is {MAX_ATTRIBUTE_CHARS}")
        if not isinstance(value, str) or not normalise(value):
            raise InvalidAtomError(f"profile value must be a non-empty string, got {value!r}")
        shown = " ".join(value.split())
        if len(shown) > self.store.max_chars:
            raise InvalidAtomError(f"profile value has {len(shown)} characters; the cap is {self.store.max_chars}")
        if kind not in KINDS:
            raise InvalidAtomError(f"profile kind {kind!r} is not one of {', '.join(KINDS)}")
        day = None if time is None else parse_day(time)
        return ProfileCandidate(name, attr, shown, day, clean_strings(source_ids, "source_ids"), kind)

    # ------------------------------------------------------------------ queue
    def queue(self, participant: str, attribute: str, value: str, *, time: Any = None,
              source_ids: Sequence[str] = (), kind: str = "trait") -> ProfileCandidate:
        """Validate a candidate and queue it for the next :meth:`flush` (nothing is written)."""
        cand = self.candidate(participant, attribute, value, time=time, source_ids=source_ids, kind=kind)
        self._queue.append(cand)
        return cand

    @property
    def pending(self) -> tuple[ProfileCandidate, ...]:
        return tuple(self._queue)

    def discard(self) -> int:
        """Drop the queued candidates without applying them; returns how many there were."""
        n = len(self._queue)
        self._queue.clear()
        return n

    # ------------------------------------------------------------------ flush
    def flush(self, session_time: Any) -> FlushReport:
        """Apply the queue (see the module docstring) and return the decisions and their counts."""
        session = parse_day(session_time)
        order = sorted(range(len(self._queue)), key=lambda i: (self._queue[i].time or session, i))
        staged: dict[tuple[str, str], ProfileRecord] = {}
        decisions: list[tuple[ProfileCandidate, str]] = []
        for i in order:
            cand = self._queue[i]
            key = (_pkey(cand.participant), cand.attribute)
            if key not in staged and key in self._records:
                staged[key] = copy.deepcopy(self._records[key])  # never mutate the mirror before the write
            decisions.append((cand, self._apply(staged, key, cand, cand.time or session)))
        counts = {d: 0 for d in DECISIONS}
        for _, d in decisions:
            counts[d] += 1
        self._write(list(staged.values()))
        self._records.update(staged)
        self._queue.clear()
        return FlushReport(session, counts, decisions)

    @staticmethod
    def _apply(staged: dict, key: tuple[str, str], cand: ProfileCandidate, t: dt.date) -> str:
        rec = staged.get(key)
        if rec is None:
            staged[key] = ProfileRecord(cand.participant, cand.attribute,
                                        Version(cand.value, t, None, list(cand.source_ids), cand.kind), t)
            return "create"
        value = normalise(cand.value)
        cur = rec.current
        if value == normalise(cur.value):
            cur.sources = list(dict.fromkeys(cur.sources + list(cand.source_ids)))
            rec.last_seen = max(rec.last_seen, t)
            return "redundant"
        if t < cur.since:
            in_force = next((v for v in rec.history if v.since <= t and (v.until is None or t < v.until)), None)
            if in_force is not None and normalise(in_force.value) == value:
                in_force.sources = list(dict.fromkeys(in_force.sources + list(cand.source_ids)))
                return "redundant"
            later = [v.since for v in rec.history if v.since > t] + [cur.since]
            if in_force is not None:
                in_force.until = t
            rec.history.append(Version(cand.value, t, min(later), list(cand.source_ids), cand.kind))
            rec.history.sort(key=lambda v: v.since)  # stable: a same-day revision follows the version it ends
            return "revise_history"
        rec.history.append(dataclasses.replace(cur, until=t))
        rec.history.sort(key=lambda v: v.since)
        rec.current = Version(cand.value, t, None, list(cand.source_ids), cand.kind)
        rec.last_seen = max(rec.last_seen, t)
        return "update"

    def _write(self, records: list[ProfileRecord]) -> None:
        """Upsert records; if a later chunk fails, restore the earlier chunks, then raise."""
        done: list[ProfileRecord] = []
        try:
            for s in range(0, len(records), self.batch_size):
                chunk = records[s : s + self.batch_size]
                docs = [r.document for r in chunk]
                vectors = self.embedder.embed(docs)  # per chunk: one model call per Chroma call
                self.store._chroma(
                    "writing profiles", self.collection.upsert,
                    ids=[r.id for r in chunk], documents=docs, embeddings=vectors,
                    metadatas=[r.metadata() for r in chunk],
                )
                done.extend(chunk)
        except MemoryStoreError:
            self._restore(done)
            raise

    def _restore(self, written: list[ProfileRecord]) -> None:
        """Put back what ``written`` replaced: the mirror's previous records, or nothing."""
        if not written:
            return
        try:
            old = [self._records[(_pkey(r.participant), r.attribute)] for r in written
                   if (_pkey(r.participant), r.attribute) in self._records]
            new_ids = [r.id for r in written if (_pkey(r.participant), r.attribute) not in self._records]
            for s in range(0, len(old), self.batch_size):
                chunk = old[s : s + self.batch_size]
                self.collection.upsert(ids=[r.id for r in chunk], documents=[r.document for r in chunk],
                                       embeddings=self.embedder.embed([r.document for r in chunk]),
                                       metadatas=[r.metadata() for r in chunk])
            for s in range(0, len(new_ids), self.batch_size):
                self.collection.delete(ids=new_ids[s : s + self.batch_size])
        except Exception:  # the original error is the one worth reporting
            pass

    # ------------------------------------------------------------------ reading
    def participants(self) -> list[str]:
        """Participants with a stored profile or on the roster, sorted."""
        names = {_pkey(r.participant): r.participant for r in self._records.values()}
        for k, v in (self.roster or {}).items():
            names.setdefault(k, v)
        return sorted(names.values())

    def _records_of(self, participant: Any) -> list[ProfileRecord]:
        if not isinstance(participant, str) or not participant.strip():
            raise InvalidAtomError(f"participant must be a non-empty string, got {participant!r}")
        key = _pkey(participant)
        recs = [r for (pk, _), r in self._records.items() if pk == key]
        if not recs and (self.roster is None or key not in self.roster):
            raise UnknownParticipantError(
                f"no profile for participant {participant!r} in namespace {self.store.namespace!r}"
            )
        return recs

    def profile(self, participant: str) -> dict[str, dict]:
        """attribute -> {value, since, kind, sources, last_seen, history: [older versions]}.

        Empty for a roster member without attributes; UnknownParticipantError for anyone else
        without a stored profile."""
        return {r.attribute: r.to_dict() for r in sorted(self._records_of(participant), key=lambda r: r.attribute)}

    def render(self, participant: str, max_chars: int = 600) -> str:
        """Compact text for prompts: one line per attribute, most recently seen first, each with its
        previous value; whole lines are dropped to stay within ``max_chars``. "" when empty."""
        if not isinstance(max_chars, int) or isinstance(max_chars, bool) or max_chars < 1:
            raise InvalidAtomError(f"max_chars must be a positive integer, got {max_chars!r}")
        recs = sorted(self._records_of(participant), key=lambda r: (-r.last_seen.toordinal(), r.attribute))
        if not recs:
            return ""
        out = f"Profile of {recs[0].participant}:"
        if len(out) > max_chars:
            return out[:max_chars]
        for r in recs:
            line = f"\n- {r.attribute}: {r.current.value} (since {r.current.since.isoformat()}"
            if r.history:
                prev = r.history[-1]
                line += f"; before: {prev.value} until {prev.until.isoformat() if prev.until else '?'}"
                if len(r.history) > 1:
                    line += f", +{len(r.history) - 1} older"
            line += ")"
            if len(out) + len(line) > max_chars:
                continue  # a shorter later line may still fit
            out += line
        return out

    def drop(self) -> None:
        """Delete the profile collection."""
        self.store._chroma("dropping the profiles", self.store.client.delete_collection, self.name)
        self._records.clear()
        self._queue.clear()
