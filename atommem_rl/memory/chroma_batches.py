"""The store's Chroma operations that take more than one call, each call within Chroma's batch limit.

    pages               a namespace read back page by page (a reopened store rebuilding its mirror)
    add_all_or_nothing  new atoms added in batches; if a batch fails after others landed, those are
                        deleted again, so the caller sees the whole write or none of it
    contents            everything Chroma holds for a namespace, comparable across stores (tests)

``chroma`` is the store's calling wrapper (``chroma(what, fn, **kwargs)``: pending writes first,
errors translated to the store's types, see ``chroma_clients.translate_error``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from .atom import Atom, to_chroma_metadata
from .errors import MemoryStoreError


def pages(chroma: Callable, collection, batch_size: int, include: list[str]) -> Iterator[dict]:
    """Every record of ``collection`` (``include``: the fields wanted), one ``get`` per page."""
    offset = 0
    while True:
        page = chroma("loading atoms", collection.get, include=include, limit=batch_size, offset=offset)
        yield page
        if len(page["ids"]) < batch_size:
            return
        offset += batch_size


def add_all_or_nothing(chroma: Callable, collection, atoms: Sequence[Atom], vectors, batch_size: int,
                       refuse_existing: Callable[[list[str]], None]) -> None:
    """Add ``atoms`` with their ``vectors``; ``refuse_existing`` checks each batch's ids first (Chroma's
    ``add`` silently ignores an id it holds). On a MemoryStoreError the batches that landed are
    deleted again (best effort: the original error is the one raised)."""
    written: list[str] = []
    try:
        for start in range(0, len(atoms), batch_size):
            chunk = atoms[start : start + batch_size]
            refuse_existing([a.id for a in chunk])
            chroma(
                "adding atoms", collection.add,
                ids=[a.id for a in chunk],
                documents=[a.text for a in chunk],
                embeddings=vectors[start : start + len(chunk)],
                metadatas=[to_chroma_metadata(a) for a in chunk],
            )
            written.extend(a.id for a in chunk)
    except MemoryStoreError:
        if written:  # roll back the batches that did land
            for s in range(0, len(written), batch_size):
                try:
                    collection.delete(ids=written[s : s + batch_size])
                except Exception:  # the original error is the one worth reporting
                    pass
        raise


def contents(chroma: Callable, collection) -> dict[str, tuple]:
    """What ``collection`` holds, id -> (document, metadata, embedding rounded to 6 places)."""
    got = chroma("reading the namespace", collection.get, include=["documents", "metadatas", "embeddings"])
    return {i: (d, m, tuple(round(float(x), 6) for x in e)) for i, d, m, e in
            zip(got["ids"], got["documents"], got["metadatas"], got["embeddings"])}
