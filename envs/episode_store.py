"""The episode's memory store: a fresh AtomStore namespace per reset on the configured Chroma client (by
default one shared in-memory client per process), with write-behind and exact in-process reads chosen by
the backend: batched and exact for in-memory Chroma; write-through and Chroma reads for persistent and
server backends, whose acknowledged writes must be durable."""

from __future__ import annotations

import itertools
import os
import uuid

from atommem_rl.memory.store import AtomStore

from .config import EnvConfig

# Namespaces of up to this many atoms in an in-memory client are read by exact cosine in process
# (``AtomStore(exact_below=...)``): faster than Chroma's HNSW at that size, and deterministic; HNSW
# built with several insert threads returns near-tied neighbours in a run-dependent order.
IN_MEMORY_EXACT_BELOW = 8192

_ns_counter = itertools.count()
_CLIENT = None


def default_client():
    """One in-memory Chroma client per process (every EphemeralClient shares one database anyway;
    building a client costs about 70 ms of settings parsing)."""
    global _CLIENT
    if _CLIENT is None:
        from atommem_rl.memory.chroma_clients import make_client

        _CLIENT = make_client("memory")
    return _CLIENT


def in_memory(client) -> bool:
    try:
        s = client.get_settings()
        return not s.is_persistent and "fastapi" not in str(s.chroma_api_impl).lower()
    except Exception:  # a client we do not know: keep every write durable, every read in Chroma
        return False


def write_behind(client, config: EnvConfig) -> int:
    if config.write_behind is not None:
        return config.write_behind
    return 64 if in_memory(client) else 0


def exact_below(client, config: EnvConfig) -> int:
    if config.exact_below is not None:
        return config.exact_below
    return IN_MEMORY_EXACT_BELOW if in_memory(client) else 0


def open_store(client, embedder, config: EnvConfig) -> AtomStore:
    """A new, empty store in a namespace no other episode (of any process) uses."""
    ns = f"env-{os.getpid()}-{next(_ns_counter)}-{uuid.uuid4().hex[:8]}"
    return AtomStore(ns, client=client, embedder=embedder, max_chars=config.max_atom_chars,
                     write_behind=write_behind(client, config), exact_below=exact_below(client, config))
