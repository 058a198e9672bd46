"""The sessions of ``atommem serve`` and the one worker thread that runs them.

A session is a namespace of the server's store (a persistent folder by default, or a ``chroma run``
server), driven by a :class:`~atommem_rl.agent.MemoryAgent` sharing the server's one policy, so one
session can only ever read its own atoms. Every request becomes a job on one queue; the worker takes
what has queued (waiting ``batch_wait`` seconds for more), and runs rounds: each round takes the oldest
job of every session with work, steps all their observations together (``observe_many``: one policy
call per step for all of them), then all their questions (``ask_many``), then the cheap jobs. Jobs
of one session run in the order they came; a reply is sent only after the job's writes are in the
store (write-through on persistent and server stores), so an acknowledged observation survives a
``kill -9`` of the server.
"""

from __future__ import annotations

import queue
import re
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from atommem_rl.agent import MemoryAgent, ask_many, observe_many
from atommem_rl.agent.agent import blocks_of
from atommem_rl.agent.state import STATE_SUFFIX, is_state_collection
from atommem_rl.memory.store import COLLECTION_PREFIX

SESSION_ID = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9_.]|-(?!-)){0,62}[A-Za-z0-9]$|^[A-Za-z0-9]$")


class SessionError(Exception):
    """A request's error for the client: ``status`` (404 unknown session, 409 exists, 400 bad input)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Job:
    kind: str  # create | observe | ask | memories | delete
    session: str
    payload: Any = None
    future: Future = field(default_factory=Future)


def check_session_id(sid: Any) -> str:
    if not isinstance(sid, str) or not SESSION_ID.match(sid):
        raise SessionError(400, f"session ids are 1-64 characters of [A-Za-z0-9._-], starting and ending with a "
                                f"letter or digit, no '--'; got {sid!r:.80}")
    return sid


class Sessions:
    """Sessions over ``client``; ``make_agent(session id)`` opens a session's MemoryAgent (one shared policy)."""

    def __init__(self, make_agent, client, batch_wait: float = 0.01, max_batch: int = 64):
        self.make_agent, self.client = make_agent, client
        self.batch_wait, self.max_batch = batch_wait, max_batch
        self.open: dict[str, MemoryAgent] = {}
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.rounds = {"policy_rounds": 0, "batched_sessions": 0}
        self.thread = threading.Thread(target=self._run, name="atommem-serve-worker", daemon=True)
        self.thread.start()

    # ---------------------------------------------------------------- the request side
    def submit(self, kind: str, session: str, payload: Any = None) -> Future:
        job = Job(kind, session, payload)
        self.jobs.put(job)
        return job.future

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)
        for agent in self.open.values():
            agent.close()

    def known(self) -> list[str]:
        """Every session in the store (those of earlier server runs included)."""
        names = [c if isinstance(c, str) else c.name for c in self.client.list_collections()]
        return sorted(n[len(COLLECTION_PREFIX):-len(STATE_SUFFIX)] for n in names if is_state_collection(n))

    # ---------------------------------------------------------------- the worker side
    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            batch = [job]
            deadline = time.monotonic() + self.batch_wait
            while len(batch) < self.max_batch:
                try:
                    nxt = self.jobs.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None:
                    self.jobs.put(None)  # stop after this batch
                    break
                batch.append(nxt)
            self._rounds(batch)

    def _rounds(self, batch: list[Job]) -> None:
        per: dict[str, list[Job]] = {}
        for job in batch:
            per.setdefault(job.session, []).append(job)
        while per:
            heads = [jobs.pop(0) for jobs in per.values()]
            per = {s: jobs for s, jobs in per.items() if jobs}
            self._model_jobs([j for j in heads if j.kind == "observe"], observe_many)
            self._model_jobs([j for j in heads if j.kind == "ask"], ask_many)
            for job in heads:
                if job.kind not in ("observe", "ask"):
                    self._settle(job, lambda job=job: getattr(self, "_" + job.kind)(job))

    def _model_jobs(self, jobs: list[Job], run_many) -> None:
        ready = []
        for job in jobs:
            try:
                agent = self._agent(job.session)
                if job.kind == "observe":  # a content the environment cannot take fails alone, before any step
                    content, options = job.payload
                    blocks_of(content, 0, **options)
                ready.append((job, agent))
            except Exception as exc:  # noqa: BLE001 - that job's error, not the batch's
                job.future.set_exception(exc)
        if not ready:
            return
        try:
            out = run_many([(agent, *_args(job.payload)) for job, agent in ready])
        except Exception as exc:  # noqa: BLE001 - mid-step (the store went away): no job of the round is acknowledged
            for job, _ in ready:
                job.future.set_exception(exc)
            return
        self.rounds["policy_rounds"] += 1
        self.rounds["batched_sessions"] += len(ready)
        for (job, _), result in zip(ready, out):
            job.future.set_result(result)

    @staticmethod
    def _settle(job: Job, fn) -> None:
        try:
            job.future.set_result(fn())
        except Exception as exc:  # noqa: BLE001 - delivered to the request, which answers it
            job.future.set_exception(exc)

    def _exists(self, sid: str) -> bool:
        if sid in self.open:
            return True
        try:
            self.client.get_collection(COLLECTION_PREFIX + sid + STATE_SUFFIX)
            return True
        except Exception:  # noqa: BLE001 - chromadb raises NotFoundError (or ValueError in older builds)
            return False

    def _agent(self, sid: str) -> MemoryAgent:
        if sid not in self.open:
            if not self._exists(sid):
                raise SessionError(404, f"no session {sid!r}")
            self.open[sid] = self.make_agent(sid)
        return self.open[sid]

    def _create(self, job: Job) -> dict:
        sid = job.session
        if self._exists(sid):
            raise SessionError(409, f"session {sid!r} exists")
        agent = self.make_agent(sid)
        agent.env._save()  # the record makes the session known to later server runs
        self.open[sid] = agent
        return {"session": sid}

    def _memories(self, job: Job) -> dict:
        agent = self._agent(job.session)
        out = {"session": job.session, "memories": agent.memories(), "scratchpad": agent.scratchpad}
        if job.payload and job.payload.get("query"):
            out["views"] = agent.search(job.payload["query"])
        return out

    def _delete(self, job: Job) -> dict:
        agent = self._agent(job.session)
        agent.delete()
        self.open.pop(job.session, None)
        return {"session": job.session, "deleted": True}


def _args(payload: Any) -> tuple:
    """A job's payload as the arguments after the agent: (content, options) or (question,)."""
    return payload if isinstance(payload, tuple) else (payload,)


def new_session_id() -> str:
    return "s" + uuid.uuid4().hex[:16]
