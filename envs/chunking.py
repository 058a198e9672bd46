"""Cutting a task's blocks into chunks of at most ``chunk_tokens`` tokens of the policy's tokenizer.

Chunks pack whole lines (a block's header, then one line per unit); a block that continues into the next
chunk repeats its header with "(continued)"; a single unit longer than a chunk is split on token
boundaries. Counts are exact: a chunk whose joined text overflows moves its last lines on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .sanitize import deheading, defang
from .tokens import PolicyTokens


@dataclass
class Chunk:
    text: str
    unit_ids: list[str]
    tokens: int


def make_chunks(blocks: list, render_block: Callable, tokens: PolicyTokens, limit: int) -> list[Chunk]:
    """The chunks of ``blocks`` in order; ``render_block(block)`` gives (header, [(unit id or None, line)])."""
    count = tokens.count_memo  # one memo per tokenizer, shared with prompt counting
    chunks: list[Chunk] = []
    entries: list[tuple[str, str | None]] = []  # (line, unit id or None) of the open chunk
    used = 0

    def flush() -> None:
        """Close the open chunk; lines that make the exact count overflow move to the next one."""
        nonlocal entries, used
        carry: list[tuple[str, str | None]] = []
        while entries:
            text = "\n".join(e[0] for e in entries)
            n = tokens.count(text)
            if n <= limit or len(entries) == 1:
                chunks.append(Chunk(text, [u for _, u in entries if u], n))
                break
            carry.insert(0, entries.pop())  # sums of parts can undercount a join
        entries = carry
        used = sum(count(e[0]) + 1 for e in entries)

    for block in blocks:
        header, items = render_block(block)
        header = deheading(defang(header))
        in_chunk = False  # is this block's header already in the open chunk?
        for j, (uid, line) in enumerate(items):
            line = deheading(defang(line))
            n = count(line) + 1
            hdr = header if j == 0 else header + " (continued)"
            hcost = 0 if in_chunk else count(hdr) + 1
            if entries and used + hcost + n > limit:
                flush()
                in_chunk = False
                hdr = header if j == 0 else header + " (continued)"
                hcost = count(hdr) + 1
            if not in_chunk and hcost + n <= limit:
                entries.append((hdr, None))
                used += hcost
                in_chunk = True
            if n <= limit - used:
                entries.append((line, uid))
                used += n
                continue
            rest = line  # one unit longer than a chunk: split it on token boundaries
            while rest:
                piece = tokens.truncate(rest, max(8, limit - used - 1)) or rest[:20]
                entries.append((piece, uid))
                rest = rest[len(piece):]
                flush()
            in_chunk = False
    while entries:
        flush()
    return chunks
