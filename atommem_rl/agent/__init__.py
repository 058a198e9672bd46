"""The trained memory policy in users' hands: ``MemoryAgent`` (agent.py) over a live environment
(live_env.py) whose namespace and agent record (state.py) persist in any Chroma store."""

from .agent import MemoryAgent, QuestionVisibleWarning, Reply, ask_many, observe_many

__all__ = ["MemoryAgent", "QuestionVisibleWarning", "Reply", "ask_many", "observe_many"]
