"""Rollouts: run a policy on tasks, every active episode of a step batched into one policy call.

Algorithm. ``run_rollouts(tasks, policy, env_config, batch_size)`` keeps up to ``batch_size``
episodes open; each iteration collects the current observation of every open episode, asks the
policy for all actions at once (``policy.act(batch)``: one generation call for a model policy),
steps each environment, records the step (prompt messages, completion, reward, tool results), and
replaces finished episodes with new tasks. An exception inside an environment step or reset, or
raised by the policy itself (``start``, ``act``), is that episode's *crash*: it is counted, the
traceback is recorded in the trajectory, and the episode is closed (a bad *action* never causes one:
the environments turn it into an error observation). :func:`start_episode` and :func:`act_or_crash`
are the guards, shared with ``atommem eval``. A store outage
(``StoreUnavailableError``: the Chroma server is down) is not a crash: the episode's attempt fails with
that error (server URL and operation named), and the task is retried from the start with backoff
once the server answers again, or skipped after ``retries``; the run goes on (``run_rollouts``).

Trajectories (one JSON object per episode) hold the task id, per-step records
``{"prompt": messages, "completion": text, "reward": x, "results": [...], "phase": ...}`` and the
outcome (score, em, f1, per-question predictions, evidence recall, relation accuracy, confounder
token share, op counts, tokens). ``summarize`` gives the JSON that ``atommem rollout`` prints
(DESIGN.md section 4).

Launch: ``atommem rollout --tasks FILE --policy oracle --out runs/oracle.jsonl``
(``--chroma http://127.0.0.1:8000`` to use a ``chroma run`` server).
"""

from __future__ import annotations

import heapq
import json
import time
import traceback
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from envs import make_env
from envs.core import OPS, EnvConfigError

from .memory.chroma_clients import address, is_up
from .memory.errors import StoreUnavailableError
from .memory.store import COLLECTION_PREFIX
from .policies.base import Policy, PolicyUnavailable
from .tasks.schema import Task


class Crash:
    """What :func:`start_episode` or :func:`act_or_crash` give instead of a result when the environment's
    reset or the policy raised: that episode's crash (``error``: one line, ``traceback``), not the run's."""

    __slots__ = ("error", "traceback")

    def __init__(self, exc: BaseException):
        self.error = f"{type(exc).__name__}: {exc}"
        self.traceback = traceback.format_exc()


def start_episode(env, policy: Policy, key, task: Task, seed: int):
    """``env.reset(seed=seed)`` then ``policy.start(key, task)``: ``(obs, info)``, or a :class:`Crash`
    when either raised (the policy is then told to forget ``key``). A configuration error
    (``EnvConfigError``) and a store outage (``StoreUnavailableError``) are raised: the first is the
    caller's, the second is retried by :func:`run_rollouts`. Shared by rollouts and ``atommem eval``."""
    try:
        obs, info = env.reset(seed=seed)
        policy.start(key, task)
    except (StoreUnavailableError, EnvConfigError):
        raise
    except Exception as exc:  # noqa: BLE001 - this episode's crash, not the run's
        crash = Crash(exc)
        try:
            policy.end(key)
        except Exception:  # noqa: BLE001 - start may have failed before the policy knew the key
            pass
        return crash
    return obs, info


def act_or_crash(policy: Policy, batch: list) -> list:
    """One policy call for the batch. If it raises, each episode is asked alone, so the exception crashes
    only the episodes it comes from (their slot is a :class:`Crash`) and the others go on. A
    :class:`~atommem_rl.policies.base.PolicyUnavailable` (the generation server is gone) is the run's, not
    an episode's: it is raised, never retried per episode (under several trainer processes each retry would
    be one more collective round on this rank only). Shared by rollouts and ``atommem eval``."""
    try:
        return policy.act(batch)
    except PolicyUnavailable:
        raise
    except Exception:  # noqa: BLE001
        pass
    out = []
    for item in batch:
        try:
            out.append(policy.act([item])[0])
        except PolicyUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - a policy crash is that episode's finding
            out.append(Crash(exc))
    return out


def make_policy(name: str, **kw) -> Policy:
    """oracle | heuristic | random | fuzz | model (keywords go to the policy's constructor)."""
    if name == "oracle":
        from .policies.oracle import OraclePolicy

        return OraclePolicy(**kw)
    if name == "heuristic":
        from .policies.heuristic import HeuristicPolicy

        return HeuristicPolicy(**kw)
    if name == "random":
        from .policies.scripted import RandomPolicy

        return RandomPolicy(**kw)
    if name == "fuzz":
        from .policies.scripted import FuzzPolicy

        return FuzzPolicy(**kw)
    if name == "model":
        from .policies.model_policy import ModelPolicy

        return ModelPolicy(**kw)
    raise ValueError(f"unknown policy {name!r}; expected oracle, heuristic, random, fuzz or model")


def run_rollouts(tasks: Iterable[Task], policy: Policy, env_config: dict | None = None, *,
                 batch_size: int = 8, seed: int = 0, record_prompts: bool = True,
                 on_episode=None, retries: int = 3, retry_backoff: float = 2.0, max_backoff: float = 30.0,
                 keep_memory: bool = False, replay: dict | None = None) -> list[dict]:
    """Run one episode per task; returns the trajectories (also passed to ``on_episode`` as they end).

    Store outages (``StoreUnavailableError``: the Chroma server went away) fail the affected episode's
    *attempt*, not the run: the failure (error, server URL, operation, step, namespace, and the memory
    the store had acknowledged) is appended to the record's ``failures``, and the task is retried from
    its first step with the same seed after ``retry_backoff * 2**attempt`` seconds (capped at
    ``max_backoff``), and only once the server answers a heartbeat; after ``retries`` retries it is
    *skipped*: its record has ``skipped: True`` and no outcome. While the server is down no new task
    is opened unless nothing else is pending. ``keep_memory`` keeps every episode's namespace in
    Chroma (its name is in the record) instead of dropping it when the episode ends.

    ``replay`` forks episodes: ``{key: {"seed": s, "actions": [...]}}`` resets task ``key``'s environment
    with seed ``s`` (instead of ``seed + key``) and applies the recorded ``actions`` before the policy acts,
    so the episode continues from the exact state another episode reached after them (the environment is
    deterministic for a seed and an action sequence). Replayed steps are recorded with ``"replayed": True``
    and count in the return; the policy is asked only from the first step after them.
    """
    if retries < 0 or retry_backoff < 0:
        raise ValueError("retries and retry_backoff must be non-negative")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        # with no episode open the scheduler loop would spin forever waiting for one
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    env_config = dict(env_config or {})
    client = env_config.get("client")
    url = address(client) if client is not None else "in-process"
    fresh = deque(enumerate(tasks))
    waiting: list[tuple[float, int, Task, int]] = []  # heap of (due time, task index, task, attempt)
    failures: dict[int, list[dict]] = {}
    orphans: list[str] = []  # namespaces of failed attempts, dropped once the server is back
    active: dict[int, dict] = {}
    done: list[dict] = []
    outage = False

    def new_record(task: Task, attempt: int) -> dict:
        return {"task_id": task.id, "source": task.source, "kind": task.kind, "policy": policy.name, "steps": [],
                "crashed": False, "skipped": False, "attempts": attempt + 1, "started": time.perf_counter()}

    def finish(key: int, rec: dict) -> None:
        rec["key"] = key  # the task's index in this call (records arrive in finishing order)
        rec["failures"] = failures.pop(key, [])
        done.append(rec)
        if on_episode is not None:
            on_episode(rec)

    def fail(key: int, task: Task, attempt: int, env, exc: StoreUnavailableError, step: int | None) -> None:
        """Record a failed attempt; schedule the retry or skip the task."""
        nonlocal outage
        outage = True
        store = getattr(env, "store", None)
        failures.setdefault(key, []).append({
            "attempt": attempt, "error": str(exc), "url": exc.url or url, "operation": exc.operation, "step": step,
            "namespace": store.namespace if store is not None else None,
            # write-through (the server backends' mode), the mirror holds exactly the writes Chroma
            # acknowledged: the store updates it only after Chroma answered
            "memory": env.memory_snapshot() if env is not None and record_prompts else None,
        })
        if env is not None:
            if store is not None and not keep_memory:
                orphans.append(store.namespace)
            env.store = None  # MemoryEnv.close would try to drop the namespace on a server that is down
            env.close()
        if key in active:
            active.pop(key)
            policy.end(key)
        if attempt < retries:
            due = time.monotonic() + min(max_backoff, retry_backoff * 2 ** attempt)
            heapq.heappush(waiting, (due, key, task, attempt + 1))
        else:
            rec = new_record(task, attempt)
            rec.pop("started")
            rec.update(skipped=True, score=None, em=None, f1=None, seconds=0.0, memory=None)
            finish(key, rec)

    def server_up() -> bool:
        """During an outage, one heartbeat decides whether episodes may be opened; the first success
        ends the outage and drops the namespaces that failed attempts left behind."""
        nonlocal outage
        if not outage:
            return True
        if client is not None and not is_up(client):
            return False
        outage = False
        while orphans:
            ns = orphans.pop()
            try:
                client.delete_collection(COLLECTION_PREFIX + ns)
            except Exception:  # noqa: BLE001 - an attempt may have failed before its collection existed
                pass
        return True

    def crash(key: int, rec: dict, env, tb: str) -> None:
        """The episode ends as a crash (counted, traceback kept); the run goes on."""
        rec.update(crashed=True, traceback=tb, score=0.0, em=0.0, f1=0.0)
        rec.setdefault("memory", None)
        rec["seconds"] = time.perf_counter() - rec.pop("started")
        if env is not None:
            env.close()
        finish(key, rec)

    def open_episode(key: int, task: Task, attempt: int) -> None:
        rec = new_record(task, attempt)
        env = make_env(task, **env_config)  # a configuration error raises here: the caller's bug
        fork = replay.get(key) if replay else None
        try:  # a retry replays the same episode
            started = start_episode(env, policy, key, task, fork["seed"] if fork else seed + key)
        except StoreUnavailableError as exc:
            fail(key, task, attempt, env, exc, step=0)
            return
        if isinstance(started, Crash):
            crash(key, rec, env, started.traceback)
            return
        obs, info = started
        rec["namespace"] = env.store.namespace if env.store is not None else None
        active[key] = {"env": env, "obs": obs, "info": info, "rec": rec, "return": 0.0, "task": task,
                       "attempt": attempt}
        for action in (fork or {}).get("actions", []):
            if key not in active or not apply(key, action, replayed=True):
                return

    def apply(key: int, action, replayed: bool = False) -> bool:
        """Step episode ``key`` with ``action`` and record the step; False once the episode is over."""
        st = active[key]
        try:
            obs, reward, terminated, truncated, info = st["env"].step(action)
        except StoreUnavailableError as exc:  # the server went away: retry the episode later
            fail(key, st["task"], st["attempt"], st["env"], exc, step=len(st["rec"]["steps"]))
            return False
        except Exception:  # noqa: BLE001 - a crash is a finding, recorded and counted
            st["rec"]["crashed"] = True
            st["rec"]["traceback"] = traceback.format_exc()
            close(key, None)
            return False
        st["return"] += reward
        st["rec"]["steps"].append({
            "phase": st["info"].get("phase"),
            "prompt": st["obs"] if record_prompts else None,
            "completion": action,
            "reward": reward,
            "results": info.get("results"),
            "prompt_tokens": st["info"].get("prompt_tokens"),
            **({"replayed": True} if replayed else {}),
        })
        st["obs"], st["info"] = obs, info
        if terminated or truncated:
            close(key, info)
            return False
        return True

    def close(key: int, info: dict | None) -> None:
        st = active.pop(key)
        rec = st["rec"]
        env = st["env"]
        info = info or st["info"]
        rec["return"] = st["return"]
        rec["seconds"] = time.perf_counter() - rec.pop("started")
        for k in ("score", "em", "f1", "questions", "evidence_recall", "relation_accuracy",
                  "confounder_token_share", "terminated", "ops", "tool_errors", "format_errors", "tokens",
                  "relation_checks", "judge_errors"):
            if k in info:
                rec[k] = info[k]
        rec.setdefault("score", 0.0)
        rec.setdefault("em", 0.0)
        rec.setdefault("f1", 0.0)
        rec["memory"] = env.memory_snapshot() if record_prompts else None
        if keep_memory and env.store is not None:
            try:  # a store in write-behind mode holds writes Chroma has not seen yet
                getattr(env.store, "flush", lambda: None)()
            except StoreUnavailableError as exc:
                rec["keep_memory_error"] = str(exc)
            env.store = None  # MemoryEnv.close drops the namespace; detached, it stays in Chroma
        env.close()
        policy.end(key)
        finish(key, rec)

    while fresh or waiting or active:
        up = server_up()
        while waiting and waiting[0][0] <= time.monotonic() and len(active) < batch_size:
            _, key, task, attempt = heapq.heappop(waiting)
            if up:
                open_episode(key, task, attempt)
            else:  # the retry was due and the server still does not answer: that attempt failed too
                fail(key, task, attempt, None, StoreUnavailableError(
                    f"Chroma server {url} still unreachable when retry {attempt} was due",
                    url=url, operation="reopening the episode"), step=None)
            up = not outage
        # while the server is down, a new task is opened only when nothing else is pending, so a dead
        # server ends the run after each task's bounded retries instead of hanging it
        while fresh and len(active) < batch_size and (up or (not active and not waiting)):
            key, task = fresh.popleft()
            open_episode(key, task, 0)
            up = not outage
        if not active:
            if waiting:
                time.sleep(max(0.0, min(waiting[0][0] - time.monotonic(), 1.0)))
            continue
        keys = list(active)
        actions = act_or_crash(policy, [(k, active[k]["obs"], active[k]["info"]) for k in keys])
        for k, action in zip(keys, actions):
            if isinstance(action, Crash):
                st = active.pop(k)
                policy.end(k)
                st["rec"]["memory"] = st["env"].memory_snapshot() if record_prompts else None
                crash(k, st["rec"], st["env"], action.traceback)
                continue
            apply(k, action)
    return done


def summarize(trajectories: list[dict], policy: str) -> dict:
    """The ``atommem rollout`` summary (DESIGN.md section 4); em and f1 in 0-1.

    ``episodes`` and every metric cover the episodes that ran to the end; ``skipped`` counts tasks
    given up after store outages, ``retried`` the finished episodes that needed more than one attempt,
    ``store_failures`` every failed attempt (see ``run_rollouts``)."""
    skipped = [t for t in trajectories if t.get("skipped")]
    trajectories = [t for t in trajectories if not t.get("skipped")]
    n = len(trajectories)
    ops = {op: 0 for op in OPS}
    tokens = {"prompt": 0, "completion": 0}
    tool_errors = 0
    for t in trajectories:
        for op, c in (t.get("ops") or {}).items():
            ops[op] = ops.get(op, 0) + c
        for k in tokens:
            tokens[k] += (t.get("tokens") or {}).get(k, 0)
        tool_errors += t.get("tool_errors", 0)

    def mean(key):
        vals = [t[key] for t in trajectories if t.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    return {
        "episodes": n,
        "policy": policy,
        "mean_reward": mean("return") or 0.0,
        "em": mean("em") or 0.0,
        "f1": mean("f1") or 0.0,
        "crashes": sum(1 for t in trajectories if t.get("crashed")),
        "tool_errors": tool_errors,
        "ops": ops,
        "tokens": tokens,
        "evidence_recall": mean("evidence_recall"),
        "relation_accuracy": mean("relation_accuracy"),
        "confounder_token_share": mean("confounder_token_share"),
        "truncated": sum(1 for t in trajectories if t.get("terminated") is False),
        "store_failures": sum(len(t.get("failures") or []) for t in trajectories + skipped),
        "retried": sum(1 for t in trajectories if t.get("failures")),
        "skipped": len(skipped),
    }


def write_jsonl(records: Iterable[dict], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, default=str) + "\n")  # ASCII: completions may hold lone surrogates


def load_policy_kwargs(spec: str | None) -> dict[str, Any]:
    return json.loads(spec) if spec else {}
