"""Checks of the quickstart's arguments that need more than their type: the evaluated methods, the
retrieval phase's embedder spec and LoCoMo file, and an explicit base model folder.

Called by ``QuickstartConfig.__post_init__``, so ``atommem quickstart`` refuses a bad argument with one
line before its first phase instead of after SFT and GRPO have run (a misspelt method surfaced only in
the evaluation phase, an unknown embedder in the last one). Nothing here loads a model.

    check_arguments(cfg)        # raises ValueError / FileNotFoundError naming the flag
"""

from __future__ import annotations

from pathlib import Path


def check_methods(methods: str) -> list[str]:
    """The comma-separated baselines, each a method ``atommem eval`` knows (checkpoints are given with
    ``--checkpoints``), none twice; an empty list evaluates the checkpoints alone."""
    from atommem_rl.eval.methods import ALL_METHODS

    names = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in ALL_METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown method(s) {', '.join(unknown)}; choose from {','.join(ALL_METHODS)}")
    twice = sorted({m for m in names if names.count(m) > 1})
    if twice:
        raise ValueError(f"--methods: {', '.join(twice)} given more than once")
    return names


def check_embedder_spec(spec: str) -> None:
    """The spec forms ``memory.embeddings.make_embedder`` builds, checked without building one (MiniLM
    would load a model here)."""
    kind, _, rest = spec.partition(":")
    if spec == "minilm" or (kind == "hashing" and (not rest or (rest.isdigit() and int(rest) > 0))):
        return
    if kind == "st" and rest:
        if not Path(rest).exists():
            raise FileNotFoundError(f"--embedder {spec}: no sentence-transformers model at {rest}")
        return
    if kind == "openai" and "#" in rest and all(rest.split("#", 1)):
        return
    raise ValueError(f"--embedder: unknown embedder spec {spec!r}; use hashing[:DIM], minilm, st:PATH or "
                     "openai:URL#MODEL")


def check_arguments(cfg) -> None:
    """Every argument of a ``QuickstartConfig`` beyond what its own ``__post_init__`` checks."""
    check_methods(cfg.methods)
    if "retrieval" not in cfg.skip:
        check_embedder_spec(cfg.embedder)
    if cfg.locomo is not None and not Path(cfg.locomo).is_file():
        # only an explicit file must exist: without one, a missing default skips the phase (said in the report)
        raise FileNotFoundError(f"--locomo: no LoCoMo file at {cfg.locomo}")
    if cfg.base_model is not None:
        # a folder that is not a model used to be filled with a fresh conversion of the packaged GGUF
        from atommem_rl.training.checkpoints import check_model

        check_model(cfg.base_model)
