"""The old name of :mod:`atommem_rl.memory.chroma_clients` (Chroma clients), kept only so that
``envs/core.py`` keeps importing while its owner moves it to the new name; delete it then. New code
imports ``chroma_clients``, which cannot be mistaken for the model engines of ``eval/backend.py``."""

from .chroma_clients import BackendConfig, address, is_unavailable, is_up, make_client, parse_url, translate_error

__all__ = ["BackendConfig", "address", "is_unavailable", "is_up", "make_client", "parse_url", "translate_error"]
