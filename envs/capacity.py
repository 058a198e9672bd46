"""A bounded memory (``capacity``): a create at capacity is refused (``on_full="refuse"``) or makes room by
evicting the least recently shown atom, Evidence before Primary (``on_full="evict"``). Deleted and fused-away
atoms do not count; "shown" is the step an atom last appeared in a prompt (or was created)."""

from __future__ import annotations

from atommem_rl.memory.atom import Role

from .tools import ToolError


def is_full(capacity: int | None, size: int) -> bool:
    return capacity is not None and size >= capacity


def refuse_if_full(capacity: int | None, on_full: str, size: int) -> None:
    """``ToolError`` for a create at capacity when the policy must make room itself."""
    if is_full(capacity, size) and on_full == "refuse":
        raise ToolError(f"memory is full ({capacity} entries): update or delete entries first")


def evict(store, last_shown: dict[str, int], handle_of: dict[str, str]) -> str | None:
    """Delete the least recently shown atom (Evidence before Primary); returns its handle."""
    primaries = [a for a in store.atoms(roles=(Role.PRIMARY, Role.EVIDENCE))]
    if not primaries:
        return None
    victim = min(primaries, key=lambda a: (a.role is Role.PRIMARY, last_shown.get(a.id, -1), a.created_at))
    store.delete(victim.id)
    return handle_of.get(victim.id, victim.id)
