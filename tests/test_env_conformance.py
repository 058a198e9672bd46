"""One conformance test over every environment: types, determinism under a seed, terminated versus
truncated, budgets enforced, prompt length exact in the policy's tokens (real Chroma, real tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from atommem_rl.policies.oracle import OraclePolicy
from atommem_rl.tasks import prepare
from atommem_rl.tasks.synth import generate_task
from envs import make_env
from envs.dialogue import DialogueEnv
from envs.documents import DocumentEnv
from envs.parser import format_tool_call as tc
from envs.tokens import load_tokenizer

from .conftest import DATA

FIXTURES = Path(__file__).parent / "fixtures"


def _locomo_small():
    task = prepare.prepare_locomo(DATA / "locomo" / "locomo10.json", limit=1, questions_per_task=3)[0]
    keep = {e for q in task.questions for e in q.evidence}
    blocks = [b for b in task.blocks if any(u.id in keep for u in b.units)][:3]
    task.blocks = blocks
    ids = {u.id for b in blocks for u in b.units}
    task.questions = [q for q in task.questions if set(q.evidence) <= ids] or task.questions[:1]
    return task


TASKS = {
    "synthetic-documents": lambda: generate_task(0, 7, kind="documents", docs=12, questions=3, confounders=2),
    "synthetic-dialogue": lambda: generate_task(1, 7, kind="dialogue", docs=6, questions=2, confounders=1),
    "hotpotqa": lambda: prepare.prepare_hotpotqa(DATA / "hotpotqa" / "hotpotqa_train_100.json", docs=8, questions=2, limit=4)[0],
    "musique": lambda: prepare.prepare_musique(DATA / "musique" / "musique_train_100.json", docs=8, questions=1, limit=2)[0],
    "locomo": _locomo_small,
    "longmemeval": lambda: prepare.prepare_longmemeval(FIXTURES / "longmemeval_mini.json")[0],
}
CFG = dict(tokenizer="smollm2", chunk_tokens=256, max_prompt_tokens=2048, embedder="hashing")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


def _run(env, policy, key, task, seed=0):
    obs, info = env.reset(seed=seed)
    policy.start(key, task)
    trace = [obs]
    total, terminated, truncated = 0.0, False, False
    while not (terminated or truncated):
        action = policy.act([(key, obs, info)])[0]
        obs, reward, terminated, truncated, info = env.step(action)
        trace.append(obs)
        total += reward
    policy.end(key)
    return trace, total, terminated, truncated, info


@pytest.mark.parametrize("name", list(TASKS))
def test_conformance(name, tok):
    task = TASKS[name]()
    env = make_env(task, **CFG)
    assert isinstance(env, DialogueEnv if task.kind == "dialogue" else DocumentEnv)
    obs, info = env.reset(seed=3)
    # types: chat messages and a dict
    assert isinstance(obs, list) and all(isinstance(m, dict) and set(m) == {"role", "content"} for m in obs)
    assert [m["role"] for m in obs] == ["system", "user"]
    assert isinstance(info, dict) and info["phase"] in ("chunks", "answer")
    assert tok.prompt_tokens(obs) <= CFG["max_prompt_tokens"]
    # the first chunk is in the prompt, whole
    assert env.chunks[0].text in obs[1]["content"]
    out = env.step("")
    assert len(out) == 5
    o, r, te, tr, inf = out
    assert isinstance(o, list) and isinstance(r, float) and isinstance(te, bool) and isinstance(tr, bool)
    assert isinstance(inf, dict) and set(inf["ops"]) >= {"create", "read", "update", "delete", "relate", "scratchpad", "answer"}
    env.close()

    # determinism: same task and seed -> identical observations, rewards and outcome
    runs = []
    for _ in range(2):
        env = make_env(task, **CFG)
        runs.append(_run(env, OraclePolicy(), 0, task, seed=5))
        env.close()
    (t1, r1, te1, tr1, i1), (t2, r2, te2, tr2, i2) = runs
    assert t1 == t2 and r1 == r2 and i1["questions"] == i2["questions"]
    # answering ends the episode: terminated, not truncated
    assert te1 and not tr1
    assert i1["ops"]["answer"] == len(task.questions)
    for obs in t1:
        assert tok.prompt_tokens(obs) <= CFG["max_prompt_tokens"]

    # a policy that never answers is truncated, not terminated, at the step budget
    env = make_env(task, **CFG, max_answer_steps=2)
    env.reset(seed=0)
    steps, done = 0, False
    while not done:
        _, r, te, tr, info = env.step("I am thinking.")
        steps += 1
        done = te or tr
    assert tr and not te and steps == len(env.chunks) + 2
    assert info["score"] == 0.0
    with pytest.raises(RuntimeError):
        env.step("")
    env.close()


def test_budgets_and_caps(tok):
    task = generate_task(0, 1, docs=8, questions=2, confounders=0)
    env = DocumentEnv(task, **CFG, read_budget=2, capacity=2, on_full="refuse", scratchpad_tokens=20)
    env.reset(seed=0)
    act = "".join(tc("read_memory", {"query": f"q{i}"}) for i in range(3))
    act += tc("create_memory", {"content": "Fact one about Paris."}) + tc("create_memory", {"content": "Fact two about Rome."})
    act += tc("create_memory", {"content": "Fact three about Oslo."})
    act += tc("write_scratchpad", {"content": "word " * 200})
    act += tc("answer", {"question_id": "Q1", "answer": "x"})
    obs, _, _, _, info = env.step(act)
    res = info["results"]
    assert [r["ok"] for r in res] == [True, True, False, True, True, False, True, False]
    assert "read budget" in res[2]["message"] and "full" in res[5]["message"] and "answer phase" in res[7]["message"]
    assert tok.count(env.scratchpad) <= 20 and "[...cut]" in env.scratchpad
    assert len(env.store) == 2 and info["ops"]["read"] == 2 and info["ops"]["create"] == 2
    text = obs[1]["content"]
    assert "read budget exhausted" in text and "[M1]" in text
    env.close()
    # evict instead of refuse: the store stays at capacity
    env = DocumentEnv(task, **CFG, capacity=2, on_full="evict")
    env.reset(seed=0)
    _, _, _, _, info = env.step(act)
    assert len(env.store) == 2 and info["ops"]["create"] == 3
    env.close()


def test_penalties_cost_steps_with_failed_calls():
    """error_penalty once per step with any failed call (here an unknown tool next to a good one);
    format_penalty only for a malformed call, on top; a clean step or one without calls costs nothing."""
    task = generate_task(0, 2, docs=30, questions=1, confounders=0)
    env = DocumentEnv(task, **CFG, error_penalty=0.25, format_penalty=0.5)
    env.reset(seed=0)
    assert len(env.chunks) > 4  # every step below is a chunk step
    good = tc("create_memory", {"content": "A fact."})
    rewards = [env.step(a)[1] for a in (good, good + tc("think", {"x": 1}) + tc("think", {"y": 2}), "no call at all",
                                        good + "<tool_call>\n{not json\n</tool_call>")]
    assert rewards == [0.0, -0.25, 0.0, -0.75]
    assert env.tool_errors == 3 and env.format_errors == 1
    env.close()
    with pytest.raises(ValueError, match="must not be negative"):
        DocumentEnv(task, **CFG, error_penalty=-1.0)


def test_ablations_remove_tools():
    task = generate_task(0, 2, docs=6, questions=1, confounders=0)
    env = DocumentEnv(task, **CFG, disable=("update", "delete", "relations", "scratchpad"))
    obs, info = env.reset(seed=0)
    assert set(info["tools"]) == {"create_memory", "read_memory", "answer"}
    assert "# Scratchpad" not in obs[1]["content"]
    _, _, _, _, info = env.step(tc("write_scratchpad", {"content": "x"}) + tc("create_memory", {"content": "A fact."})
                                 + tc("delete_memory", {"id": "M1"}))
    assert [r["ok"] for r in info["results"]] == [False, True, False]
    env.close()
    env = DocumentEnv(task, **CFG, disable="store")
    obs, info = env.reset(seed=0)
    assert "# Memory" not in obs[1]["content"] and env.store is None
    _, _, _, _, info = env.step(tc("create_memory", {"content": "A fact."}))
    assert not info["results"][0]["ok"]
    env.close()


def test_prompt_fits_exactly_and_marks_cuts(tok):
    """Memory views and scratchpad are cut with visible marks; the chunk is never cut."""
    task = generate_task(3, 4, docs=30, questions=3, confounders=2)
    cap = 1500
    env = DocumentEnv(task, tokenizer="smollm2", chunk_tokens=200, max_prompt_tokens=cap, retrieval_k=12,
                      scratchpad_tokens=400)
    obs, _ = env.reset(seed=0)
    long_fact = "Alpha Beta Gamma " * 40
    for step in range(4):
        act = "".join(tc("create_memory", {"content": f"{long_fact} item {step}-{i}"}) for i in range(3))
        act += tc("write_scratchpad", {"content": "note " * 390})
        act += tc("read_memory", {"query": "Alpha Beta Gamma"})
        chunk = env.chunks[env.chunk_index + 1].text if env.chunk_index + 1 < len(env.chunks) else None
        obs, _, te, tr, info = env.step(act)
        n = tok.count(tok.render(obs))  # the whole rendered prompt, counted the slow way
        assert n <= cap, n
        assert info["prompt_tokens"] == n
        if chunk is not None and env.phase == "chunks":
            assert chunk in obs[1]["content"]
    text = obs[1]["content"]
    assert "prompt limit" in text or "cut" in text
    env.close()
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        DocumentEnv(task, tokenizer="smollm2", chunk_tokens=600, max_prompt_tokens=700).reset(seed=0)


def test_piece_counts_add_up_to_the_whole_prompt(tok):
    """The env counts its prompt from memoised piece counts (envs/tokens.py); on random prompts built
    from hostile text, odd Unicode and whitespace at the junctions the sum equals the count of the whole
    rendered prompt, and the env's own figure equals it at every step of an episode."""
    import random

    from tests.test_fuzz import HOSTILE_CHUNK

    assert tok.joinable  # else the fast path is off and every step counts the whole prompt
    rng = random.Random(0)
    words = ["Alice", "moved", "to", "Paris", "in", "1990.", "\u00e9t\u00e9", "\u4e2d\u6587", "\U0001f642", "'s", "--",
             "<tool_call>", "{\"name\":", "\u0301", "\t", " ", "\n", "[M3]", "# Heading", "(x)", "42"] + HOSTILE_CHUNK
    system = "You manage a memory.\n\n# Tools\n{}"
    for _ in range(300):
        pieces = []
        for _ in range(rng.randint(1, 12)):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(0, 8)))
            pieces.append(text + rng.choice(["\n", "\n\n", "", " ", "\n "]))
        whole = tok.count(tok.render([{"role": "system", "content": system},
                                      {"role": "user", "content": "".join(pieces)}]))
        assert tok.prompt_tokens_pieces(system, pieces) == whole, pieces

    task = generate_task(2, 9, docs=16, questions=3, confounders=2)
    env = DocumentEnv(task, **dict(CFG, max_prompt_tokens=1500, chunk_tokens=200, retrieval_k=8))
    obs, info = env.reset(seed=0)
    trace = [(obs, info)]
    policy = OraclePolicy()
    policy.start(0, task)
    done = False
    while not done:
        obs, _, te, tr, info = env.step(policy.act([(0, obs, info)])[0] + tc("write_scratchpad", {"content": "note  \n" * 80}))
        trace.append((obs, info))
        done = te or tr
    env.close()
    for obs, info in trace[:-1]:
        assert info["prompt_tokens"] == tok.count(tok.render(obs))
    assert any("prompt limit" in obs[1]["content"] or "cut to fit" in obs[1]["content"] for obs, _ in trace[:-1])
