"""TRL environment_factory adapter: chunks through next_chunk, tools return text, reward at the end."""

from __future__ import annotations

import inspect
import json

from atommem_rl.tasks.synth import generate_task
from envs.trl_adapter import make_factory


def test_single_conversation_episode():
    task = generate_task(0, 9, docs=4, questions=1, confounders=0)
    Env = make_factory(tokenizer="words", chunk_tokens=200, max_prompt_tokens=2400)
    env = Env()
    intro = env.reset(task=json.dumps(task.to_dict()))
    assert "next_chunk" in intro and task.questions[0].question in intro
    assert env.answer("Q1", "x").startswith("error")
    ev = set(task.questions[0].evidence)
    while True:
        chunk = env.next_chunk()
        if chunk.startswith("No more input"):
            break
        for u in task.units().values():
            if u.id in ev and u.text in chunk:
                assert env.create_memory(u.text).startswith("stored as M")
    assert env.create_memory(123).startswith("error")  # type: ignore[arg-type]
    assert env.delete_memory("M99").startswith("error")
    shown = env.read_memory(task.questions[0].question)
    assert "[M1]" in shown
    assert "recorded" in env.answer("Q1", task.questions[0].answers[0])
    assert env.get_reward() == 1.0
    tools = [n for n, f in inspect.getmembers(Env, inspect.isfunction) if not n.startswith("_") and n not in ("reset", "get_reward")]
    assert set(tools) == {"next_chunk", "create_memory", "read_memory", "update_memory", "delete_memory", "label_relation", "answer"}
