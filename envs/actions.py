"""What each tool call does once its arguments are checked (envs/tools.py): one plain function per tool,
taking the episode state it reads or writes as arguments. A refused call raises ``ToolError`` before it
changes anything; a store error (``MemoryStoreError``) likewise leaves the memory as it was. Each returns
the result dict whose ``message`` goes into the next prompt."""

from __future__ import annotations

from typing import Callable

from atommem_rl.memory.atom import Relation, TimeSpan

from .capacity import evict, is_full, refuse_if_full
from .config import EnvConfig
from .sanitize import clip
from .tokens import PolicyTokens
from .tools import ToolError, new_handle, resolve_handle

Attribute = Callable[[str], list[str]]  # atom text -> the task units it restates (envs/attribution.py)


def write_scratchpad(content: str, cap: int, tokens: PolicyTokens) -> tuple[str, dict]:
    """(new scratchpad, result): the text, cut to ``cap`` tokens with a visible mark when longer."""
    text = content.strip()
    if tokens.count_memo(text) > cap:
        text = tokens.truncate(text, max(0, cap - 8)).rstrip() + " [...cut]"
        return text, {"message": f"scratchpad saved, cut to {cap} tokens"}
    return text, {"message": "scratchpad saved"}


def create_memory(args: dict, store, config: EnvConfig, attribute: Attribute, handles: dict[str, str],
                  handle_of: dict[str, str], last_shown: dict[str, int], step: int) -> dict:
    """Store a new atom under the next handle; at capacity refuse, or evict first (said in the result)."""
    content = args["content"].strip()
    if not content:
        raise ToolError("create_memory: content is empty")
    refuse_if_full(config.capacity, config.on_full, len(store))
    sources = attribute(content)
    TimeSpan.parse(args.get("time"))  # a bad time is refused before anything is evicted
    evicted = evict(store, last_shown, handle_of) if is_full(config.capacity, len(store)) else None
    atom = store.create(content, time=args.get("time"), source_ids=sources)
    handle = new_handle(handles, handle_of, atom.id)
    last_shown[atom.id] = step
    # the eviction is said in this call's result line, which the next prompt shows
    note = f" (memory full: evicted {evicted})" if evicted else ""
    out = {"message": f"stored as {handle}{note}", "handle": handle, "sources": sources}
    return {**out, "evicted": evicted} if evicted else out


def read_memory(args: dict, pending_queries: list[str]) -> dict:
    """Queue a query: its views are shown in the next prompt."""
    q = args["query"].strip()
    if not q:
        raise ToolError("read_memory: query is empty")
    pending_queries.append(q)
    return {"message": f"results for {clip(q, 60)!r} are shown under Memory"}


def update_memory(args: dict, store, handles: dict[str, str], handle_of: dict[str, str],
                  extra_sources: dict[str, set[str]], attribute: Attribute) -> dict:
    aid = resolve_handle(args["id"], handles, store)
    content = args["content"].strip()
    if not content:
        raise ToolError("update_memory: content is empty")
    extra = attribute(content)
    store.update(aid, content)
    atom = store.get(aid)
    if extra:  # keep attribution in the env (source ids are not rewritten by update)
        extra_sources.setdefault(aid, set()).update(extra)
    return {"message": f"{handle_of[aid]} updated", "handle": handle_of[aid], "role": atom.role.value}


def delete_memory(args: dict, store, handles: dict[str, str], handle_of: dict[str, str]) -> dict:
    aid = resolve_handle(args["id"], handles, store)
    store.delete(aid)
    return {"message": f"{handle_of[aid]} deleted", "handle": handle_of[aid]}


def label_relation(args: dict, store, handles: dict[str, str], handle_of: dict[str, str],
                   on_label: Callable[[str, str, Relation], None]) -> dict:
    """Label (new, old); the store derives the roles, ``on_label`` scores the label against gold."""
    new, old = resolve_handle(args["new"], handles, store, "new"), resolve_handle(args["old"], handles, store, "old")
    try:
        rel = Relation.parse(args["label"])
    except ValueError:
        raise ToolError(f"unknown label {clip(args['label'], 40)!r}; use one of {', '.join(r.value for r in Relation)}") from None
    changed = store.relate(new, old, rel)
    on_label(new, old, rel)
    roles = ", ".join(f"{handle_of.get(a, a)} is now {r.value}" for a, r in sorted(changed.items()))
    return {"message": f"{rel.value}({handle_of[new]}, {handle_of[old]})" + (f": {roles}" if roles else "")}


def answer(args: dict, phase: str, pending: list, questions: list, answers: dict[str, str]) -> dict:
    """Record the answer to an open question (``pending``) in ``answers``; answer phase only."""
    if phase != "answer":
        raise ToolError("answer is only available in the answer phase, after the last chunk")
    qid = args.get("question_id")
    if qid is None:
        if len(pending) != 1:
            raise ToolError("answer: question_id is required when several questions are open")
        qid = pending[0].id
    qid = question_id(qid, [q.id for q in questions])
    if qid not in {q.id for q in pending}:
        if qid in answers:
            raise ToolError(f"{qid} was already answered")
        raise ToolError(f"no open question {clip(qid, 20)!r}; open: {', '.join(q.id for q in pending)}")
    answers[qid] = args["answer"].strip()[:500]
    return {"message": f"answer to {qid} recorded", "question_id": qid}


def question_id(given: str, ids: list[str]) -> str:
    """The task's own id for what the policy wrote: exact, then case-insensitive, then with the
    "Q" prefix the prompt shows added ("1" -> "Q1"); anything else is returned as given."""
    given = given.strip()
    if given in ids:
        return given
    folded = {i.casefold(): i for i in ids}
    for cand in (given, "q" + given):
        if cand.casefold() in folded:
            return folded[cand.casefold()]
    return given
