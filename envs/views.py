"""The memory views a prompt shows: the store searched for the current query, which is the policy's own
``read_memory`` queries of the previous step, or the question(s) when it issued none (``auto_retrieve``),
or the current chunk while the questions are hidden."""

from __future__ import annotations

from atommem_rl.memory.errors import MemoryStoreError, StoreUnavailableError

from .config import EnvConfig
from .sanitize import clip, defang


def current_views(store, pending_queries: list[str], questions: list, config: EnvConfig,
                  fallback: str = "") -> tuple[str, list]:
    """(query label, views) for the current prompt; ``questions`` are the ones the prompt shows. With no
    question shown (``questions: hidden`` while reading) the automatic query is ``fallback``, the
    current chunk: what is already stored about it (to update or relate) rather than nothing."""
    if store is None or len(store) == 0:
        return "", []
    queries = list(pending_queries)
    label = defang("; ".join(repr(clip(q, 80)) for q in queries))
    if not queries:
        if not config.auto_retrieve or not (questions or fallback.strip()):
            return "", []
        queries = [" ".join(q.question for q in questions)[:2000] if questions else fallback[:2000]]
        label = "the question(s)" if questions else "the current chunk"
    views, seen = [], set()
    for q in queries:
        for v in search(store, q, config.retrieval_k, config.retrieval):
            if v.id not in seen:
                seen.add(v.id)
                views.append(v)
    return label, views


def search(store, query: str, k: int, strategy: str) -> list:
    """The best ``k`` views for one query ([] for a query the store refuses; an unavailable store raises)."""
    try:
        if strategy == "dense":
            return store.read(query, k)
        from atommem_rl.memory.retrieval import retrieve

        return retrieve(store, query, k, strategy=strategy)
    except StoreUnavailableError:
        raise  # an empty memory view would silently change what the policy sees
    except (MemoryStoreError, ValueError):
        return []
