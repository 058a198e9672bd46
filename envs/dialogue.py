"""Multi-session dialogue environment: LoCoMo, LongMemEval and synthetic dialogue tasks.

The input is a sequence of dated sessions; each is rendered as ``[Session S3, 1:56 pm on 8 May,
2023]`` followed by one ``Speaker: utterance`` line per turn; chunks pack whole turns (a session may
span chunks; its header repeats with "(continued)"). A natural set-up is one session per chunk
(``chunk_tokens`` at least the longest session). Everything else is the shared core,
``envs.core.MemoryEnv``; LoCoMo tasks usually use ``reward="locomo_f1"``.

    from envs.dialogue import DialogueEnv
    env = DialogueEnv(task, chunk_tokens=1024, reward="locomo_f1")
"""

from __future__ import annotations

from .core import EnvConfig, MemoryEnv

__all__ = ["DialogueEnv", "EnvConfig"]


class DialogueEnv(MemoryEnv):
    kind = "dialogue"
    name = "dialogue"

    def render_block(self, block):
        head = f"[Session {block.id}" + (f", {block.date}]" if block.date else "]")
        return head, [(u.id, f"{u.speaker or 'Speaker'}: {u.text.strip()}") for u in block.units if u.text.strip()]
