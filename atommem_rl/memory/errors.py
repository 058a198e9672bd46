"""Exceptions raised by the atomic memory.

Every error the store raises on bad input is a subclass of :class:`MemoryStoreError`, so callers
(the environments, which must never crash on a policy's output) can catch one type and turn the
message into an observation. Each is raised *before* anything is written, or after the partial
write has been rolled back: a failed call leaves the store exactly as it was.
"""


class MemoryStoreError(Exception):
    """Base class of every error the memory store raises on purpose."""


class InvalidAtomError(MemoryStoreError, ValueError):
    """The atom's text or fields are unusable: empty or whitespace text, text over the length cap,
    an unparsable time anchor, a malformed id."""


class InvalidMetadataError(InvalidAtomError):
    """Metadata Chroma cannot store: nested dicts, empty or mixed-type lists, non-string keys,
    values that are not str/int/float/bool/None, or keys that collide with the store's own."""


class AtomNotFoundError(MemoryStoreError, KeyError):
    """The id is unknown in this namespace, or names an atom that was deleted."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "atom not found"


class InvalidRelationError(MemoryStoreError, ValueError):
    """Unknown relation label, an atom related to itself, or a label that would make atoms
    demote each other in a cycle."""


class CapacityError(MemoryStoreError):
    """The namespace is at its configured capacity and the policy chose to refuse new atoms."""


class StoreUnavailableError(MemoryStoreError, ConnectionError):
    """The Chroma backend cannot be reached (server down, wrong host or port, connection dropped
    mid-request). ``url`` names the server (``http://host:port``, or ``in-process``) and
    ``operation`` what the store was doing; the message states both.

    The outcome of the interrupted write is unknown (the server may have applied it before it
    went away), so the store marks its mirror stale and rebuilds it from Chroma before its next
    operation (``AtomStore.resync``). Rollouts retry the episode (``atommem_rl.rollout``)."""

    def __init__(self, message: str, *, url: str | None = None, operation: str | None = None):
        super().__init__(message)
        self.url = url
        self.operation = operation
