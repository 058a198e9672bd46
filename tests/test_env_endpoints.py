"""The environment's endpoint paths end to end: a model policy behind an OpenAI-compatible endpoint,
the LLM-judge reward, and one-question-per-step answering (``answer_mode="each"``).

The endpoint is a real HTTP server on 127.0.0.1 whose replies are scripted (the way TRL's tests script
a model's output): in the chunk phase it stores a memory; in the answer phase it answers the one open
question, correctly for Q1 and wrongly for the others; as a judge it says CORRECT exactly when the
model answer equals a gold answer. So the expected reward is known without a model.
"""

from __future__ import annotations

import re

import pytest

from atommem_rl.policies.model_policy import ModelPolicy
from atommem_rl.rollout import run_rollouts
from atommem_rl.tasks.synth import generate_task
from envs.parser import format_tool_call as tc

from .conftest import JsonEndpoint, chat_reply


class ScriptedEndpoint(JsonEndpoint):
    def __init__(self, gold: dict[str, str]):
        self.gold = gold
        super().__init__(lambda path, headers, body: chat_reply(self.reply(body["messages"]), 50, 5))

    def reply(self, messages: list[dict]) -> str:
        user = messages[-1]["content"]
        if user.startswith("You grade answers."):  # the judge's pinned prompt
            gold = re.search(r"Gold answer: (.*)", user).group(1).split(" | ")
            answer = re.search(r"Model answer: (.*)", user).group(1)
            return "CORRECT" if answer in gold else "WRONG"
        if "# Answer phase" in user:
            qid = re.search(r"# Questions?\n(Q\d+):", user).group(1)  # answer_mode=each shows one question
            answer = self.gold[qid] if qid == "Q1" else "no idea"
            return tc("answer", {"answer": answer})
        return tc("create_memory", {"content": "A fact from this chunk."})


@pytest.fixture
def task():
    return generate_task(0, 7, docs=4, questions=3, confounders=1)


def test_openai_policy_judge_reward_and_answer_each(task):
    gold = {q.id: q.answers[0] for q in task.questions}
    assert len(gold) == 3
    ep = ScriptedEndpoint(gold)
    try:
        policy = ModelPolicy(backend="openai", base_url=ep.url, model_name="scripted")
        env_config = {"tokenizer": "words", "chunk_tokens": 256, "max_prompt_tokens": 4096, "answer_mode": "each",
                      "reward": "judge", "judge_url": ep.url, "judge_model": "judge"}
        (rec,) = run_rollouts([task], policy, env_config)
    finally:
        ep.close()
    out = rec
    assert not rec["crashed"] and out["terminated"]
    assert [q["prediction"] for q in out["questions"]] == [gold["Q1"], "no idea", "no idea"]
    assert [q["score"] for q in out["questions"]] == [1.0, 0.0, 0.0]
    assert rec["return"] == pytest.approx(1 / 3) and rec["ops"]["answer"] == 3
    assert [s["phase"] for s in rec["steps"]].count("answer") == 3  # one question per answer step
    judged = [r for r in ep.requests if r["model"] == "judge"]
    assert len(judged) == 3 and all(r["temperature"] == 0.0 for r in judged)
    policy_calls = [r for r in ep.requests if r["model"] == "scripted"]
    assert policy.tokens == {"prompt": 50 * len(policy_calls), "completion": 5 * len(policy_calls)}


def test_judge_down_scores_zero_and_reports(task):
    ep = ScriptedEndpoint({q.id: q.answers[0] for q in task.questions})
    policy = ModelPolicy(backend="openai", base_url=ep.url, model_name="scripted")
    env_config = {"tokenizer": "words", "chunk_tokens": 256, "max_prompt_tokens": 4096, "answer_mode": "each",
                  "reward": "judge", "judge_url": "http://127.0.0.1:9/v1", "judge_model": "judge"}
    try:
        (rec,) = run_rollouts([task], policy, env_config)
    finally:
        ep.close()
    out = rec
    assert not rec["crashed"] and rec["return"] == 0.0
    assert len(out["judge_errors"]) == 3 and "LLM judge http://127.0.0.1:9/v1/chat/completions failed" in out["judge_errors"][0]


def test_policy_endpoint_down_is_a_clear_error(task):
    policy = ModelPolicy(backend="openai", base_url="http://127.0.0.1:9/v1", model_name="scripted")
    with pytest.raises(ConnectionError, match="policy endpoint http://127.0.0.1:9/v1/chat/completions failed"):
        policy.act([(0, [{"role": "user", "content": "hi"}], None)])


def test_question_ids_match_whatever_their_case():
    """Task files may use lower-case ids (q1): the answer tool finds them as written, in any case,
    or as a bare number."""
    from envs.documents import DocumentEnv

    t = generate_task(0, 3, docs=2, questions=3, confounders=0)
    for i, q in enumerate(t.questions):
        q.id = f"q{i + 1}"
    env = DocumentEnv(t, tokenizer="words", max_answer_steps=3)
    env.reset(seed=0)
    while env.phase == "chunks":
        env.step("")
    _, _, _, _, info = env.step(tc("answer", {"question_id": "Q1", "answer": "a"})
                                + tc("answer", {"question_id": "q2", "answer": "b"})
                                + tc("answer", {"question_id": "3", "answer": "c"}))
    assert env.answers == {"q1": "a", "q2": "b", "q3": "c"} and env.done
