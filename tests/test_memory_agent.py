"""``MemoryAgent`` (atommem_rl/agent/): the README example run as written in two processes (observe,
ask greedily, restart, reopen the persistent namespace: atoms, roles, relations and scratchpad are
still there and the answer is the same), batching of many agents into one policy call, isolation of
namespaces, the question-hidden environment setting and the warning for a question-visible checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

from atommem_rl.tasks.schema import Task
from envs import make_env

from .conftest import REPO

# The README's example (the lead pastes it there): CHECKPOINT and STORE are filled in by the test.
README_EXAMPLE = '''
from atommem_rl import MemoryAgent

agent = MemoryAgent.from_pretrained(CHECKPOINT, store=STORE, namespace="lab")   # a folder: persistent
agent.observe("The centrifuge was moved to room 114 on Monday. Samples are kept at minus 80 degrees.",
              title="Lab notes")
agent.observe([{"role": "user", "content": "Heads up: the centrifuge is now in room 120 of the east wing."}])
reply = agent.ask("Which room is the centrifuge in?")
print(reply.answer, reply.read)
print(agent.memories(), agent.scratchpad)
agent.close()

# later, in another process: the same namespace continues where it stopped
agent = MemoryAgent.from_pretrained(CHECKPOINT, store=STORE, namespace="lab")
print(agent.ask("Which room is the centrifuge in?").answer)
'''

def test_readme_shows_the_example_this_file_runs():
    """The README's agent example is this file's README_EXAMPLE (after its line naming CHECKPOINT and STORE)."""
    from .conftest import REPO

    readme = "\n".join(line for line in (REPO / "README.md").read_text().splitlines()
                       if not line.startswith("CHECKPOINT, STORE = "))
    assert README_EXAMPLE.strip() in readme


_RUN = '''
import json, sys
from atommem_rl import MemoryAgent
CHECKPOINT, STORE, PHASE, SCRIPTED = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
kw = {{}}
if SCRIPTED:
    from tests.agent_policies import NotingPolicy
    kw["policy"] = NotingPolicy()
{body}
'''


def _script(phase_one: bool) -> str:
    """The example's first part (or its reopening part) with results printed as JSON."""
    first, later = README_EXAMPLE.split("# later, in another process")
    code = first if phase_one else "from atommem_rl import MemoryAgent\n" + later.split("\n", 1)[1]
    code = code.replace('namespace="lab")', 'namespace="lab", **kw)')
    code = code.replace("print(reply.answer, reply.read)\nprint(agent.memories(), agent.scratchpad)\nagent.close()",
                        "print(json.dumps({'answer': reply.answer, 'memories': agent.memories(), "
                        "'scratchpad': agent.scratchpad}))\nagent.close()")
    code = code.replace('print(agent.ask("Which room is the centrifuge in?").answer)',
                        "mem, pad = agent.memories(), agent.scratchpad\n"
                        "print(json.dumps({'answer': agent.ask('Which room is the centrifuge in?').answer, "
                        "'memories': mem, 'scratchpad': pad}))")
    return _RUN.format(body=code)


def _run(ckpt, store, phase_one: bool, scripted: bool) -> dict:
    res = subprocess.run([sys.executable, "-c", _script(phase_one), str(ckpt), str(store), "1" if phase_one else "2",
                          "1" if scripted else "0"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from .conftest import tiny_agent_checkpoint

    return tiny_agent_checkpoint(tmp_path_factory.mktemp("agent"))


@pytest.mark.slow
@pytest.mark.parametrize("scripted", [False, True], ids=["tiny-model", "scripted-heuristic"])
def test_readme_example_survives_a_restart(checkpoint, tmp_path, scripted):
    """The example as written, greedy; then a new process on the same persistent namespace: the same
    atoms (roles, relations), the same scratchpad, the same answer. The random tiny model writes no
    tool call; the scripted policy (the heuristic baseline plus a scratchpad note) makes the atoms and
    the scratchpad that must survive."""
    store = tmp_path / "memories"
    one = _run(checkpoint, store, True, scripted)
    two = _run(checkpoint, store, False, scripted)
    assert two["memories"] == one["memories"] and two["scratchpad"] == one["scratchpad"]
    assert two["answer"] == one["answer"]
    if scripted:
        texts = [m["text"] for m in one["memories"]]
        assert any("room 114" in t for t in texts) and any("room 120" in t for t in texts)
        assert one["scratchpad"].startswith("last read:") and one["answer"]
        assert {m["role"] for m in one["memories"]} <= {"primary", "evidence"}


def test_many_agents_share_one_policy_call_per_step_and_never_see_each_other(checkpoint):
    from atommem_rl.agent import MemoryAgent, ask_many, observe_many

    from .agent_policies import NotingPolicy

    first = MemoryAgent.from_pretrained(str(checkpoint), namespace="iso-a", policy=NotingPolicy())
    agents = [first] + [first.open(f"iso-{c}") for c in "bc"]
    facts = {"iso-a": "Ana keeps her bicycle in the blue garage.", "iso-b": "Ben keeps his kayak in the old barn.",
             "iso-c": "Cleo keeps her violin in the music room."}
    calls = []
    act = first.policy.act
    first.policy.act = lambda batch: calls.append(len(batch)) or act(batch)  # count the policy's calls
    out = observe_many([(a, facts[a.namespace]) for a in agents])
    assert calls == [3] and [o["blocks"] for o in out] == [1, 1, 1]  # one chunk each: one call for all three
    for a in agents:
        texts = " ".join(m["text"] for m in a.memories())
        assert facts[a.namespace].split(" keeps")[0] in texts
        assert all(facts[o.namespace].split(" keeps")[0] not in texts for o in agents if o is not a)
    replies = ask_many([(a, "Where does the owner keep it?") for a in agents])
    assert all(r.steps >= 1 for r in replies) and len(calls) > 1 and calls[1] == 3
    with pytest.raises(ValueError, match="appears twice"):
        observe_many([(first, "x y z w"), (first, "a b c d")])
    with pytest.raises(ValueError, match="observe takes a text"):
        first.observe(42)
    for a in agents:
        a.delete()


def test_question_visible_checkpoint_warns(tmp_path, checkpoint):
    from atommem_rl.agent import MemoryAgent, QuestionVisibleWarning
    from atommem_rl.agent.agent import agent_env

    from .agent_policies import NotingPolicy

    with pytest.warns(QuestionVisibleWarning, match="questions shown while reading"):
        agent_env(str(checkpoint), {"questions": "visible"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MemoryAgent.from_pretrained(str(checkpoint), namespace="quiet", policy=NotingPolicy()).delete()
    with pytest.warns(QuestionVisibleWarning, match="records no environment"):
        agent_env(str(tmp_path))


def test_question_hidden_setting_shows_questions_only_when_answering():
    task = Task.from_dict({"id": "t", "blocks": [{"id": "D1", "units": [{"id": "u", "text": "Oslo is in Norway."}]}],
                           "questions": [{"id": "Q1", "question": "Where is Oslo?", "answers": ["Norway"]}]})
    seen = {}
    for mode in ("visible", "hidden"):
        env = make_env(task, tokenizer="words", questions=mode)
        obs, _ = env.reset(seed=0)
        reading = obs[-1]["content"]
        obs, *_ = env.step("")
        seen[mode] = (reading, obs[-1]["content"], obs[0]["content"])
        env.close()
    assert "Where is Oslo?" in seen["visible"][0] and "Where is Oslo?" not in seen["hidden"][0]
    assert "questions asked later" in seen["hidden"][0]
    assert "Where is Oslo?" in seen["hidden"][1]  # the answer phase shows it
    assert "The questions come only after the input." in seen["hidden"][2]
