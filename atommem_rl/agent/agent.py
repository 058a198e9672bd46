"""``MemoryAgent``: a trained memory policy as a library object over a real store.

    from atommem_rl import MemoryAgent

    agent = MemoryAgent.from_pretrained("checkpoints/run/grpo", store="memories/", namespace="alice")
    agent.observe("The centrifuge moved to room 120 on Monday.")       # a document
    agent.observe([{"role": "user", "content": "My cat is called Miso."}])  # a chat session
    reply = agent.ask("Which room is the centrifuge in?")               # reply.answer, reply.read
    agent.memories()                                                   # atoms, roles, relations
    agent.close()

``from_pretrained`` loads the policy through the inference layer (``hf`` generate on CPU or GPU,
``vllm``, or ``openai`` for any OpenAI-compatible endpoint such as ``vllm serve`` of a merged checkpoint)
and the environment the checkpoint was trained in (its ``atommem_env.json``; ``env=`` overrides
settings). ``store`` is a Chroma store in any of its three modes: None (in memory, gone with the
process), a folder (persistent), ``http://HOST:PORT`` (a ``chroma run`` server), or a Chroma client.
On a persistent store the namespace (atoms, roles, relations, scratchpad, handles) is reopened by the
next ``from_pretrained`` with the same namespace and continues where it stopped.

Every step is the training environment's (``LiveEnv``, ``live_env.py``). ``observe_many``/``ask_many``
step many agents (one per namespace, sharing one policy: ``agent.open(namespace)``) together, one policy
call per round for all of them, the way rollouts batch episodes. An agent is not thread-safe: one
caller at a time (``atommem serve`` funnels every session through one worker).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from atommem_rl.policies.base import memory_lines
from atommem_rl.tasks.own import dialogue_block, document_block, is_chat

from .live_env import LiveEnv


class QuestionVisibleWarning(UserWarning):
    """The checkpoint learned to read with the questions in view; a memory agent reads without them."""


@dataclass
class Reply:
    """An answer (None when the policy never called the answer tool) and the memory views it read."""

    answer: str | None
    read: list[dict] = field(default_factory=list)  # [{"handle": "M3", "text": ...}] in the order shown
    steps: int = 0


def open_client(store: Any):
    """A Chroma client for ``store``: None (in memory), a folder (persistent), ``http://HOST:PORT``, or a client."""
    from atommem_rl.memory.chroma_clients import make_client, parse_url
    from envs.episode_store import default_client

    if store is None or store == "memory":
        return default_client()
    if isinstance(store, (str, os.PathLike)):
        s = str(store)
        if s.startswith(("http://", "https://")):
            return make_client(parse_url(s))
        return make_client("persistent", path=s)
    return store


def load_policy(checkpoint: str, backend: str = "hf", base_url: str | None = None, model_name: str | None = None,
                max_new_tokens: int = 256, temperature: float = 0.0):
    from atommem_rl.rollout import make_policy

    return make_policy("model", model=checkpoint, backend=backend, base_url=base_url, model_name=model_name,
                       max_new_tokens=max_new_tokens, temperature=temperature)


def agent_env(checkpoint: str | None, overrides: dict | None = None, warn: bool = True) -> dict:
    """The checkpoint's recorded environment with ``overrides``; warns (QuestionVisibleWarning) when it
    was trained with the questions shown while reading."""
    from atommem_rl.training.checkpoint_env import policy_env, read_env

    env = policy_env(checkpoint, overrides, source="env")
    recorded = read_env(checkpoint).get("env", {})
    if warn and env.get("questions", "visible") != "hidden":
        where = "was trained with the questions shown while reading" if recorded else "records no environment"
        warnings.warn(f"{checkpoint} {where} (questions: visible); a memory agent reads before it is asked, "
                      "which this policy has not learned: train with env_config questions: hidden",
                      QuestionVisibleWarning, stacklevel=3)
    env.pop("questions", None)  # a live agent shows no question while reading, whatever it was trained with
    return env


class MemoryAgent:
    """One memory (a namespace) driven by a policy. See the module docstring."""

    def __init__(self, policy, namespace: str, *, client=None, env: dict | None = None, tokenizer: Any = None):
        self.policy, self.namespace, self.client = policy, namespace, client if client is not None else open_client(None)
        self.settings, self.tokenizer = dict(env or {}), tokenizer
        self.env = LiveEnv(namespace, client=self.client, tokenizer=tokenizer, **self.settings)

    @classmethod
    def from_pretrained(cls, checkpoint: str, *, store: Any = None, namespace: str = "default",
                        backend: str = "hf", base_url: str | None = None, model_name: str | None = None,
                        env: dict | None = None, max_new_tokens: int = 256, temperature: float = 0.0,
                        policy=None) -> "MemoryAgent":
        """The policy of ``checkpoint`` (or ``policy``, already loaded) on ``namespace`` of ``store``."""
        settings = agent_env(checkpoint, env)
        client = open_client(store)  # an unreachable server fails here, before the model loads
        if policy is None:
            policy = load_policy(checkpoint, backend, base_url, model_name, max_new_tokens, temperature)
        tok = getattr(policy, "tok", None) or (checkpoint if os.path.isdir(str(checkpoint)) else None)
        return cls(policy, namespace, client=client, env=settings, tokenizer=tok)

    def open(self, namespace: str) -> "MemoryAgent":
        """Another namespace of the same store with the same policy and settings (no second model)."""
        return MemoryAgent(self.policy, namespace, client=self.client, env=self.settings, tokenizer=self.tokenizer)

    # ---------------------------------------------------------------- one agent
    def observe(self, content: Any, *, title: str | None = None, date: str | None = None) -> dict:
        return observe_many([(self, content, {"title": title, "date": date})])[0]

    def ask(self, question: str) -> Reply:
        return ask_many([(self, question)])[0]

    def memories(self, include_deleted: bool = False) -> list[dict]:
        """The atoms: handle, text, role, relations (by handle), time, sources, created/updated clocks."""
        env = self.env
        out = []
        for a in env.memory_snapshot():
            if a["role"] == "deleted" and not include_deleted:
                continue
            view = env.store.view(a["id"]).text if a["role"] == "primary" else None
            out.append({"handle": env.handle_of.get(a["id"], a["id"]), "id": a["id"], "text": a["text"],
                        "role": a["role"], "time": a.get("time"), "view": view,
                        "relations": {env.handle_of.get(k, k): v for k, v in a["relations"].items()},
                        "created_at": a.get("created_at"), "updated_at": a.get("updated_at")})
        return out

    def search(self, query: str, k: int | None = None) -> list[dict]:
        """The fused views the policy would be shown for ``query`` (its retrieval setting), best first."""
        from envs.views import search

        env = self.env
        if env.store is None or not len(env.store):
            return []
        views = search(env.store, query, k or env.config.retrieval_k, env.config.retrieval)
        return [{"handle": env.handle_of.get(v.id, v.id), "text": v.text, "score": round(float(v.score), 4)}
                for v in views]

    @property
    def scratchpad(self) -> str:
        return self.env.scratchpad

    def close(self) -> None:
        """Flush and release the namespace (it stays in the store)."""
        self.env.close()

    def delete(self) -> None:
        """Remove the namespace from the store: atoms, relations, scratchpad."""
        self.env.delete()


# ---------------------------------------------------------------- many agents, one policy call per round
def blocks_of(content: Any, first: int, title: str | None = None, date: str | None = None) -> list:
    """What ``observe`` takes, as blocks numbered from ``first``: a text, a list of texts, a
    ``{"title", "text"}`` document, or chat turns ``[{"role", "content"}]`` (or a list of sessions)."""
    if is_chat(content):
        sessions = [content] if isinstance(content[0], dict) else content
        return [dialogue_block(s, f"S{first + i + 1}", f"observation[{i}]", date) for i, s in enumerate(sessions)]
    docs = [content] if isinstance(content, (str, dict)) else content
    if not isinstance(docs, list) or not docs:
        raise ValueError("observe takes a text, a list of texts, a {title, text} document or chat turns "
                         f"[{{role, content}}], got {type(content).__name__}")
    if title is not None:
        docs = [{"title": title, "text": d} if isinstance(d, str) else d for d in docs]
    return [document_block(d, f"D{first + i + 1}", f"observation[{i}]", date) for i, d in enumerate(docs)]


def _drive(policy, started: dict[str, tuple[LiveEnv, list, dict]], read: dict[str, list] | None = None) -> dict:
    """Step every started env until it is idle, one ``policy.act`` per round for all of them (keyed by
    namespace, so a policy's per-episode state is per memory); returns each env's step count. ``read``
    collects the memory views each answer-phase prompt showed."""
    active = {k: [env, obs, info] for k, (env, obs, info) in started.items()}
    steps = {k: 0 for k in started}
    while active:
        keys = list(active)
        actions = policy.act([(k, active[k][1], active[k][2]) for k in keys])
        for k, action in zip(keys, actions):
            env, obs, _ = active[k]
            if read is not None:
                seen = {v["handle"] for v in read[k]}
                read[k] += [{"handle": h, "text": t} for h, t in memory_lines(obs).items() if h not in seen]
            obs, _, _, _, info = env.step(action)  # the policy's text is untrusted: the env checks every call
            steps[k] += 1
            if env.idle:
                del active[k]
            else:
                active[k][1:] = [obs, info]
    return steps


def _check_distinct(agents: list[MemoryAgent]) -> None:
    if len({a.namespace for a in agents}) != len(agents):
        raise ValueError("one agent (namespace) appears twice in a batch: give it one observation (or question) "
                         "at a time")
    if len({id(a.policy) for a in agents}) > 1:
        raise ValueError("the agents of one batch must share one policy (MemoryAgent.open)")


def observe_many(pairs: list[tuple]) -> list[dict]:
    """Each agent reads its content (``MemoryAgent.observe``), all stepped together; ``pairs`` hold
    (agent, content) or (agent, content, {"title", "date"}). Per agent {"blocks", "steps", "memories"}.
    Every content is checked before any agent takes a step."""
    _check_distinct([p[0] for p in pairs])
    blocks = [blocks_of(p[1], p[0].env.blocks_seen, **(p[2] if len(p) > 2 else {})) for p in pairs]
    pairs = [p[:2] for p in pairs]
    started = {}
    for (agent, _), bl in zip(pairs, blocks):
        first = agent.env.feed(bl)
        if first is not None:
            started[agent.namespace] = (agent.env, *first)
    steps = _drive(pairs[0][0].policy, started) if started else {}
    return [{"blocks": len(bl), "steps": steps.get(a.namespace, 0), "memories": len(a.env.store or ())}
            for (a, _), bl in zip(pairs, blocks)]


def ask_many(pairs: list[tuple[MemoryAgent, str]]) -> list[Reply]:
    """Each agent answers its question (``MemoryAgent.ask``), all stepped together."""
    _check_distinct([a for a, _ in pairs])
    for _, q in pairs:
        if not isinstance(q, str) or not q.strip():
            raise ValueError(f"a question must be a non-empty string, got {q!r:.60}")
    started = {a.namespace: (a.env, *a.env.ask(" ".join(q.split()))) for a, q in pairs}
    read: dict[str, list] = {k: [] for k in started}
    policy = pairs[0][0].policy
    try:
        steps = _drive(policy, started, read)
    finally:
        for k in started:
            policy.end(k)  # a question is an episode's answer phase: per-question policy state ends with it
    return [Reply(a.env.answers.get("Q1"), read[a.namespace], steps[a.namespace]) for a, _ in pairs]
