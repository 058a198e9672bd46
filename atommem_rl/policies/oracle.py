"""The oracle policy: the demonstration teacher. It knows the gold evidence and relation labels, but
acts only on what its prompt shows and answers from what its own memory operations made visible.

Per chunk step:
  1. stores (create_memory) every gold-evidence unit, and every older unit a gold label links to one,
     whose text is in the current chunk, as the unit's self-contained statement, with the block date;
  2. labels gold relations (label_relation) once both atoms are visible in the prompt: the new one as
     "stored as Mk" in the results, the old one among the memory views; to make the old one visible
     it reads (read_memory) with the new fact's text in the step it stores it;
  3. keeps a short scratchpad: which memories serve which question.

``supersede`` chooses how a fact that replaces an older one (gold label ``conflict``) is kept:
  * ``"label"`` (default, ROAM's way): store the new fact and label ``conflict(new, old)``; the store's
    fusion then shows the old text under the new atom (``[previously: ...]``);
  * ``"update"`` (AtomMem's CRUD way): when an older atom it replaces is shown in this prompt, rewrite
    that atom with the new fact (update_memory: the store keeps the old text as history, shown the same
    way) and delete the other shown atoms it replaces (restatements of the old fact, now outdated
    duplicates: delete_memory); when none is shown, fall back to store-and-label. This is the mode that
    demonstrates update and delete, which the label mode never calls.
``store="all"`` also stores every other unit that carries a statement (``Unit.fact``: confounders and
distractors too), as an agent must when it cannot tell what will be asked; gold labels among them are given
the same way (the ROAM setting's scripted check, docs/benchmarks/roam_setting.md).
Answer phase, for each open question:
  supported (its gold answer appears in the shown memory or scratchpad, or all its evidence atoms
  are shown) -> answer with the gold answer; otherwise read with the question, then with the text of
  a shown evidence memory (a second hop); when nothing is left to try, answer "unknown" (counted in
  ``stats()["unsupported"]``) rather than guess.
"""

from __future__ import annotations

import re
from typing import Any

from atommem_rl.scoring import normalize_answer

from .base import Policy, calls_text, memory_lines, sections

_ISO = re.compile(r"^\d{4}-\d{2}-\d{2}$")


class _Episode:
    def __init__(self, task, store_all: bool = False):
        task.require_evidence("the oracle policy")
        self.task = task
        self.units = task.units()
        self.block_date = {u.id: b.date for b in task.blocks for u in b.units}
        ev = task.evidence_ids()
        linked = {r.old for r in task.relations if r.new in ev} | {r.new for r in task.relations if r.old in ev}
        self.targets = [u for b in task.blocks for u in b.units
                        if u.id in ev or u.id in linked or (store_all and u.fact)]
        self.relations = [(r.new, r.old, r.label) for r in task.relations]
        self.unit_handle: dict[str, str] = {}
        self.handle_unit: dict[str, str] = {}
        self.pending_creates: list[str] = []
        self.labelled: set[tuple[str, str]] = set()
        self.reads_done: dict[str, int] = {}
        self.scratch = ""


class OraclePolicy(Policy):
    name = "oracle"

    SUPERSEDE = ("label", "update")

    STORE = ("needed", "all")

    def __init__(self, guess: bool = False, scratchpad: bool = True, supersede: str = "label", store: str = "needed"):
        if supersede not in self.SUPERSEDE:
            raise ValueError(f"supersede must be one of {', '.join(self.SUPERSEDE)}, got {supersede!r}")
        if store not in self.STORE:
            raise ValueError(f"store must be one of {', '.join(self.STORE)}, got {store!r}")
        self.store_all = store == "all"
        self.guess = guess
        self.use_scratchpad = scratchpad
        self.supersede = supersede
        self.eps: dict[Any, _Episode] = {}
        self.counts = {"answered": 0, "unsupported": 0}

    def start(self, key, task) -> None:
        self.eps[key] = _Episode(task, self.store_all)

    def end(self, key) -> None:
        self.eps.pop(key, None)

    def stats(self) -> dict:
        return dict(self.counts)

    def act_one(self, key, observation, info) -> str:
        ep = self.eps[key]
        # 1) learn the handles of last step's creates from the structured results
        creates = [r for r in info.get("results", []) if r.get("name") == "create_memory"]
        for uid, r in zip(ep.pending_creates, creates):
            if r.get("ok") and r.get("handle"):
                ep.unit_handle[uid] = r["handle"]
                ep.handle_unit[r["handle"]] = uid
        just_created = {r["handle"] for r in creates if r.get("ok") and r.get("handle")}
        ep.pending_creates = []
        sec = sections(observation)
        shown = memory_lines(observation)
        tools = set(info.get("tools") or []) or None
        calls: list[tuple[str, dict]] = []
        reads_left = 3
        chunk_step = info.get("phase", "chunks") == "chunks" and "chunk" in sec
        new_units = []
        if chunk_step:
            chunk = sec["chunk"]
            new_units = [u for u in ep.targets if u.id not in ep.unit_handle and u.text.strip() and u.text.strip() in chunk]
        # 1b) update mode: the new facts that rewrite a shown atom they replace (and delete its duplicates)
        edits: list[tuple[str, dict]] = []
        gone: set[str] = set()
        if self.supersede == "update" and new_units and (tools is None or {"update_memory", "delete_memory"} <= tools):
            for u in list(new_units):
                replaced = [ep.unit_handle[o] for n, o, lab in ep.relations
                            if n == u.id and lab == "conflict" and ep.unit_handle.get(o) in shown]
                replaced = [h for h in dict.fromkeys(replaced) if h not in gone]
                if not replaced:
                    continue
                edits.append(("update_memory", {"id": replaced[0], "content": u.statement()}))
                edits += [("delete_memory", {"id": h}) for h in replaced[1:]]
                gone.update(replaced[1:])
                # the rewritten atom now stands for the new fact and for the duplicates it replaced
                for uid, h in list(ep.unit_handle.items()):
                    if h in replaced[1:]:
                        ep.unit_handle[uid] = replaced[0]
                ep.unit_handle[u.id] = replaced[0]
                ep.handle_unit[replaced[0]] = u.id
                # the pairs this rewrite settles are not labelled later (they are one atom, or deleted)
                ep.labelled.update((n, o) for n, o, _ in ep.relations if u.id in (n, o))
                new_units.remove(u)
        # 2) relation labels whose two atoms are visible (none with an atom deleted this step)
        visible = (set(shown) | just_created) - gone
        for new, old, label in ep.relations:
            hn, ho = ep.unit_handle.get(new), ep.unit_handle.get(old)
            if hn and ho and hn != ho and (new, old) not in ep.labelled and hn in visible and ho in visible:
                if tools is None or "label_relation" in tools:
                    calls.append(("label_relation", {"new": hn, "old": ho, "label": label}))
                ep.labelled.add((new, old))
        calls += edits
        if chunk_step:
            for u in new_units:
                args = {"content": u.statement()}
                d = ep.block_date.get(u.id)
                if d and _ISO.match(d):
                    args["time"] = d
                calls.append(("create_memory", args))
                ep.pending_creates.append(u.id)
            # read back with the new fact when it has an older relation partner already stored
            for u in new_units:
                if reads_left and any(n == u.id and o in ep.unit_handle for n, o, _ in ep.relations):
                    calls.append(("read_memory", {"query": u.statement()[:300]}))
                    reads_left -= 1
            if self.use_scratchpad and (new_units or edits):
                note = self._note(ep)
                if note != ep.scratch:
                    calls.append(("write_scratchpad", {"content": note}))
                    ep.scratch = note
            return calls_text(calls)
        # answer phase
        text = normalize_answer(" ".join(shown.values()) + " " + sec.get("scratchpad", ""))
        open_ids = set(info.get("open_questions") or [q.id for q in ep.task.questions])
        last = info.get("answer_steps_left", 2) <= 1
        for q in ep.task.questions:
            if q.id not in open_ids:
                continue
            ev_handles = [ep.unit_handle.get(e) for e in q.evidence]
            all_shown = bool(q.evidence) and all(h in shown for h in ev_handles)
            ans_shown = any(normalize_answer(a) and f" {normalize_answer(a)} " in f" {text} " for a in q.answers)
            if all_shown or ans_shown:
                calls.append(("answer", {"question_id": q.id, "answer": q.answers[0]}))
                self.counts["answered"] += 1
                continue
            tries = ep.reads_done.get(q.id, 0)
            query = None
            if tries == 0:
                query = q.question
            elif tries == 1:
                hop = [shown[h] for h in ev_handles if h in shown]
                query = hop[0] if hop else None
            if query and reads_left and not last:
                calls.append(("read_memory", {"query": query[:300]}))
                reads_left -= 1
                ep.reads_done[q.id] = tries + 1
            elif query and not last:
                continue  # read next step
            else:
                self.counts["unsupported"] += 1
                calls.append(("answer", {"question_id": q.id, "answer": q.answers[0] if self.guess else "unknown"}))
        return calls_text(calls)

    @staticmethod
    def _note(ep: _Episode) -> str:
        parts = []
        for q in ep.task.questions:
            hs = [ep.unit_handle[e] for e in q.evidence if e in ep.unit_handle]
            if hs:
                parts.append(f"{q.id}: see {', '.join(hs)}")
        return "; ".join(parts)
