"""What an evaluation runs: the method names by kind and :class:`EvalSettings`, the settings of every method.

``ALL_METHODS`` are the methods ``atommem eval`` knows (reader, pipeline and policy methods; their code is in
``eval/methods.py`` and ``extraction/pipeline.py``), ``LLM_METHODS`` those that need a backend.
:class:`EvalSettings` checks every number and the policy environment's settings when it is made, before any
model loads; ``EVAL_ENV_KEYS`` are the environment settings the evaluation sets itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PIPELINE_METHODS = ("atommem_graph", "atommem_flat", "no_graph", "no_profile")
READER_METHODS = ("full_context", "rag", "append_all", "mem0", "memagent", "roam") + PIPELINE_METHODS
POLICY_METHODS = ("oracle", "heuristic", "atommem")
ALL_METHODS = ("oracle", "heuristic", "append_all", "rag", "full_context", "mem0", "memagent", "roam",
               "atommem") + PIPELINE_METHODS
LLM_METHODS = ("full_context", "rag", "append_all", "mem0", "memagent", "roam", "atommem") + PIPELINE_METHODS


# environment settings the evaluation sets itself (EvalSettings fields, the benchmark's reward, the
# backend's tokenizer): never taken from a policy's training environment (EvalSettings.policy_env)
EVAL_ENV_KEYS = ("reward", "tokenizer", "chunk_tokens", "max_prompt_tokens", "embedder", "retrieval_k")


@dataclass
class EvalSettings:
    seed: int = 0
    retrieval_k: int = 6
    embedder: str = "hashing"
    reader_max_new_tokens: int = 32
    manager_max_new_tokens: int = 64
    policy_max_new_tokens: int = 256
    context_tokens: int | None = None
    rag_chunk_tokens: int = 256
    mem0_k: int = 5
    memagent_chunk_tokens: int = 512
    memagent_memory_tokens: int = 256
    roam_k: int = 3
    roam_min_similarity: float = 0.35
    chunk_tokens: int = 512
    max_prompt_tokens: int = 4096
    batch_size: int = 8
    viewer_tasks: int = 1
    viewer_memory_cap: int = 80
    judge_url: str | None = None
    judge_model: str | None = None
    # further envs.core.EnvConfig settings for every policy episode (e.g. disable, max_answer_steps,
    # read_budget): a checkpoint is evaluated in the environment it was trained in. The reward stays
    # the benchmark's metric, and the tokenizer is the backend's.
    policy_env: dict = field(default_factory=dict)

    def __post_init__(self):
        self._check_numbers()
        if not isinstance(self.policy_env, dict):
            raise ValueError(f"policy_env must be a mapping of environment settings, got {self.policy_env!r}")
        fixed = sorted(set(self.policy_env) & set(EVAL_ENV_KEYS))
        if fixed:
            raise ValueError(f"policy_env cannot set {fixed}: they are evaluation settings of their own")
        from envs.core import EnvConfig

        try:  # a misspelt or out-of-range setting fails here, before any model is loaded
            EnvConfig.from_kwargs(**self.policy_env)
        except TypeError as exc:
            raise ValueError(f"policy_env: {exc}") from None


    # counts that must be at least 1 (0 episodes in flight never finishes; 0 tokens answers nothing)
    _POSITIVE = ("retrieval_k", "reader_max_new_tokens", "manager_max_new_tokens", "policy_max_new_tokens",
                 "context_tokens", "rag_chunk_tokens", "mem0_k", "memagent_chunk_tokens", "memagent_memory_tokens",
                 "roam_k", "chunk_tokens", "max_prompt_tokens", "batch_size", "viewer_memory_cap")

    def _check_numbers(self) -> None:
        """Every number is checked before any model loads; the error names the setting."""
        for name in self._POSITIVE:
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if isinstance(self.viewer_tasks, bool) or not isinstance(self.viewer_tasks, int) or self.viewer_tasks < 0:
            raise ValueError(f"viewer_tasks must be a non-negative integer, got {self.viewer_tasks!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be an integer in 0..2**32-1, got {self.seed!r}")
        s = self.roam_min_similarity
        if not isinstance(s, (int, float)) or not -1.0 <= s <= 1.0:  # NaN fails both comparisons
            raise ValueError(f"roam_min_similarity must be a cosine in [-1, 1], got {s!r}")
