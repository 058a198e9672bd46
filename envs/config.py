"""The environment's configuration: every knob as a flat field of ``EnvConfig`` (recipes and CLI flags set
them by name), checked when built, so a bad value is the caller's error with the field named, never an
episode's crash; ``EnvConfigError`` is the one configuration error only a task can reveal (reset)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable

ABLATIONS = ("update", "delete", "relations", "scratchpad", "store")


@dataclass
class EnvConfig:
    """Every knob of the environment (flat fields: recipes set them by name)."""

    chunk_tokens: int = field(default=512, metadata={"help": "chunk size in the policy's tokens"})
    max_chunks: int | None = field(default=None, metadata={"help": "cut the stream after this many chunks"})
    max_prompt_tokens: int = field(default=4096, metadata={"help": "hard cap on the rendered prompt"})
    retrieval_k: int = field(default=6, metadata={"help": "memory views per read"})
    retrieval: str = field(default="dense", metadata={"help": "how memory views are ranked", "choices": ("dense", "bm25", "hybrid", "graph")})
    auto_retrieve: bool = field(default=True, metadata={"help": "show views for the questions when no read was issued"})
    read_budget: int = field(default=3, metadata={"help": "read_memory calls per chunk step"})
    answer_read_budget: int = field(default=3, metadata={"help": "read_memory calls per answer step"})
    max_calls: int = field(default=32, metadata={"help": "tool calls read from one action"})
    scratchpad_tokens: int = field(default=256, metadata={"help": "scratchpad cap (longer writes are cut, marked)"})
    capacity: int | None = field(default=None, metadata={"help": "max active atoms (None: unbounded)"})
    on_full: str = field(default="refuse", metadata={
        "help": "a create at capacity: refuse, or evict the least recently shown Primary atom",
        "choices": ("refuse", "evict")})
    disable: tuple = field(default=(), metadata={"help": f"tool ablations, comma-separated, any of {', '.join(ABLATIONS)}"})
    questions: str = field(default="visible", metadata={
        "help": "visible: the questions are shown at every reading step (long-document QA); hidden: only in the "
                "answer phase (a memory agent whose questions come later; reads retrieve for the current chunk)",
        "choices": ("visible", "hidden")})
    answer_mode: str = field(default="all", metadata={
        "help": "all (every question at once) or each (one per step)", "choices": ("all", "each")})
    max_answer_steps: int | None = field(default=None, metadata={"help": "answer-phase steps (None: questions + 2)"})
    max_steps: int | None = field(default=None, metadata={"help": "total steps (None: chunks + answer steps)"})
    max_episode_tokens: int | None = field(default=None, metadata={"help": "prompt+completion tokens per episode"})
    answer_max_new_tokens: int | None = field(default=None, metadata={
        "help": "completion tokens an answer-phase step may take (info['max_new_tokens']; the generator stops "
                "there, as at its own limit); None: the generator's limit"})
    reward: str = field(default="em", metadata={
        "help": "answer score: em, f1, locomo_f1, judge, or package.module:function (a callable on the episode's "
                "questions, answers, predictions and episode record; docs/OWN_DATA.md)"})
    judge_url: str | None = field(default=None, metadata={"help": "OpenAI-compatible base URL for reward=judge"})
    judge_model: str | None = field(default=None, metadata={"help": "model name for the judge"})
    format_penalty: float = field(default=0.0, metadata={"help": "reward subtracted per step with malformed tool calls"})
    error_penalty: float = field(default=0.0, metadata={
        "help": "reward subtracted per step with any failed tool call (unknown tool, bad arguments, a budget "
                "or capacity refusal, a malformed call; the latter also costs format_penalty)"})
    evidence_bonus: float = field(default=0.0, metadata={"help": "shaping weight of evidence recall at answer time"})
    relation_bonus: float = field(default=0.0, metadata={"help": "shaping weight of relation-label accuracy"})
    tokenizer: Any = field(default=None, metadata={"help": "policy tokenizer: None/'smollm2', a path, 'words', or an object"})
    embedder: Any = field(default="hashing", metadata={"help": "embedder spec (hashing, minilm, st:PATH) or object"})
    client: Any = field(default=None, metadata={"help": "a Chroma client (default: in-memory)"})
    write_behind: int | None = field(default=None, metadata={
        "help": "batch this many memory writes per Chroma call (None: 64 in memory, 0 = write-through "
                "for persistent and server backends, whose acknowledged writes must be durable)"})
    exact_below: int | None = field(default=None, metadata={
        "help": "answer unfiltered reads of up to this many atoms by exact cosine in process, not a Chroma "
                "query (None: 8192 in memory, 0 = always Chroma for persistent and server backends)"})
    max_atom_chars: int = field(default=1000, metadata={"help": "longest atom text"})
    max_arg_chars: int = field(default=2000, metadata={"help": "longest string argument other than content"})
    shuffle_blocks: bool = field(default=False, metadata={"help": "shuffle block order with the reset seed"})
    parser: Callable | None = field(default=None, metadata={"help": "text -> (calls, errors); default Qwen3 parser"})

    def __post_init__(self):
        if isinstance(self.disable, str):
            self.disable = tuple(x for x in self.disable.replace(",", " ").split() if x)
        self.disable = tuple(self.disable)
        bad = set(self.disable) - set(ABLATIONS)
        if bad:
            raise ValueError(f"unknown ablations {sorted(bad)}; expected any of {ABLATIONS}")
        self._check_numbers()
        if self.chunk_tokens < 16:
            raise ValueError("chunk_tokens must be at least 16")
        if self.max_prompt_tokens < self.chunk_tokens + 64:
            raise ValueError("max_prompt_tokens must exceed chunk_tokens by at least 64")
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}, got {getattr(self, f.name)!r}")
        from atommem_rl import scoring

        if not scoring.is_custom_reward(self.reward) and self.reward not in scoring.BUILTIN_REWARDS:
            raise ValueError(f"reward must be one of {', '.join(scoring.BUILTIN_REWARDS)} or package.module:function, "
                             f"got {self.reward!r}")
        if scoring.is_custom_reward(self.reward):
            scoring.load_reward_function(self.reward)  # imported and checked now, before any work
        if self.reward == "judge" and not (self.judge_url and self.judge_model):
            raise ValueError("reward=judge needs judge_url and judge_model")

    # limits where 0 or less means nothing (max_steps=0 used to be read as "unset"); None = no limit
    _AT_LEAST_ONE = ("chunk_tokens", "max_chunks", "max_prompt_tokens", "retrieval_k", "max_calls", "capacity",
                     "max_answer_steps", "max_steps", "max_episode_tokens", "answer_max_new_tokens",
                     "max_atom_chars", "max_arg_chars")
    _AT_LEAST_ZERO = ("read_budget", "answer_read_budget", "scratchpad_tokens", "write_behind", "exact_below")
    _WEIGHTS = ("format_penalty", "error_penalty", "evidence_bonus", "relation_bonus")

    def _check_numbers(self) -> None:
        """Every count is an int in range and every weight a finite number, or the error names the field
        (a NaN bonus made every reward NaN; a negative max_atom_chars refused every memory)."""
        import math

        for name in self._AT_LEAST_ONE + self._AT_LEAST_ZERO:
            v, low = getattr(self, name), 1 if name in self._AT_LEAST_ONE else 0
            unset_ok = self.__dataclass_fields__[name].default is None
            if v is None and unset_ok:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}{' (or unset)' if unset_ok else ''}, got {v!r}")
        for name in self._WEIGHTS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number and must not be negative, got {v!r}")
        tok = self.tokenizer
        if isinstance(tok, str) and tok not in ("", "smollm2", "words") and not os.path.isdir(tok) and (
                os.path.isabs(tok) or tok.startswith((".", "~")) or os.path.exists(tok)):
            # a path that is not a folder: said here, not as the hub's "Repo id must use alphanumeric
            # chars" from deep inside transformers after the model has loaded
            raise ValueError(f"tokenizer {tok!r} is not a tokenizer folder (expected smollm2, words or a folder)")

    @classmethod
    def from_kwargs(cls, **kw) -> "EnvConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(kw) - names
        if unknown:
            raise TypeError(f"unknown environment options {sorted(unknown)}")
        return cls(**kw)


class EnvConfigError(ValueError):
    """The configuration cannot work for this task (the prompt cap cannot hold a chunk): the caller's
    error, raised at reset, never an episode's crash."""
