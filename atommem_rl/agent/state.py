"""What a memory agent keeps beside its atoms: the scratchpad, the handles it has shown the policy
(M1, M2, ...) and its counters, as one JSON record in a Chroma collection of its own next to the
namespace's atoms, so that all of it lives in the same store (in-memory, a persistent folder, or a
``chroma run`` server) and a reopened namespace continues where it stopped.

The record is written through (upsert) after every step that changes it; a persistent client
returns from the upsert after the write is on disk, so an acknowledged observation survives a
``kill -9``. Atoms, roles and relations are the AtomStore's (``atommem_rl/memory/store.py``).
"""

from __future__ import annotations

import json
from typing import Any

from atommem_rl.memory.store import COLLECTION_PREFIX

STATE_SUFFIX = "--agent"
_ID = "state"
VERSION = 1


def _name(namespace: str) -> str:
    return COLLECTION_PREFIX + namespace + STATE_SUFFIX


class AgentState:
    """The agent record of ``namespace`` on ``client`` (read on open, written by :meth:`save`)."""

    def __init__(self, client, namespace: str):
        self.client, self.namespace = client, namespace
        # a one-number vector: the record is found by id, never by similarity
        self.collection = client.get_or_create_collection(_name(namespace), embedding_function=None)
        got = self.collection.get(ids=[_ID], include=["documents"])
        self.data: dict[str, Any] = json.loads(got["documents"][0]) if got["ids"] else {}
        if self.data.get("version", VERSION) > VERSION:
            raise ValueError(f"namespace {namespace!r} was written by a newer atommem (agent state version "
                             f"{self.data['version']})")

    @property
    def exists(self) -> bool:
        return bool(self.data)

    def save(self, **fields: Any) -> None:
        self.data.update(fields, version=VERSION)
        self.collection.upsert(ids=[_ID], documents=[json.dumps(self.data)], embeddings=[[1.0]])

    def drop(self) -> None:
        try:
            self.client.delete_collection(_name(self.namespace))
        except Exception:  # noqa: BLE001 - already gone: dropping twice is not an error
            pass
        self.data = {}


def is_state_collection(name: str) -> bool:
    return name.startswith(COLLECTION_PREFIX) and name.endswith(STATE_SUFFIX)
