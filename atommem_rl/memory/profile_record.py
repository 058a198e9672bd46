"""Profile records: the versioned values of the profile layer (``memory/profiles.py``) and their Chroma form.

:class:`ProfileRecord` is one (participant, attribute) with its current :class:`Version` and the older
ones; ``metadata()`` / ``from_chroma`` are its record in the ``atommem-<namespace>.profiles`` collection
(the history as a JSON string). :class:`ProfileCandidate` is a validated, queued observation and
:class:`FlushReport` what a flush decided. :func:`normalise` is the comparison form of attributes and
values, ``_pkey`` the participant key. Pure data: no store, no Chroma calls.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any

KINDS = ("trait", "preference", "history")
DECISIONS = ("redundant", "update", "revise_history", "create")

_PUNCT = re.compile(r"[\W_]+", re.UNICODE)


def normalise(text: str) -> str:
    """The comparison form of an attribute or value (see ``memory/profiles.py``'s docstring)."""
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

