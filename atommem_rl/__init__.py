"""AtomMem-RL: train language models to manage their own long-term memory.

    from atommem_rl import MemoryAgent   # a trained checkpoint over a real store (atommem_rl/agent/)

Imported on first use, so that ``import atommem_rl`` (the CLI, the environments, which import
``atommem_rl.scoring``) loads no agent or model code: the package itself depends on nothing below it.
"""

import importlib

__all__ = ["MemoryAgent"]


def __getattr__(name: str):
    if name == "MemoryAgent":
        return importlib.import_module("atommem_rl.agent").MemoryAgent
    raise AttributeError(f"module 'atommem_rl' has no attribute {name!r}")
