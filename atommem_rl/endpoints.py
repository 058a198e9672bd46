"""The endpoint client's former import path, kept working: the client lives in
:mod:`atommem_rl.inference.endpoints` (the inference layer); ``atommem_rl.memory.embeddings`` still imports it
from here."""

from atommem_rl.inference.endpoints import MAX_RETRIES, EndpointError, Reply, chat, chat_base_url, client, embed

__all__ = ["MAX_RETRIES", "EndpointError", "Reply", "chat", "chat_base_url", "client", "embed"]
