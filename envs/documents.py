"""Document-stream environment: HotpotQA, MuSiQue and synthetic document tasks.

The input is a sequence of documents, each rendered as ``[D3] Title (2021-03-04)`` followed by its
sentences on one line each; chunks pack whole sentences up to ``chunk_tokens`` (a document that
spans two chunks repeats its header with "(continued)"). Everything else (tools, prompt, budgets,
reward) is the shared core, ``envs.core.MemoryEnv``.

    from envs.documents import DocumentEnv
    env = DocumentEnv(task, chunk_tokens=512, tokenizer="smollm2")
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(assistant_text)
"""

from __future__ import annotations

from .core import EnvConfig, MemoryEnv

__all__ = ["DocumentEnv", "EnvConfig"]


class DocumentEnv(MemoryEnv):
    kind = "documents"
    name = "documents"

    def render_block(self, block):
        head = f"[{block.id}]"
        if block.title:
            head += f" {block.title}"
        if block.date:
            head += f" ({block.date})"
        return head, [(u.id, u.text.strip()) for u in block.units if u.text.strip()]
