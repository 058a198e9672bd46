"""A policy for tests/test_memory_agent.py whose output is scripted (a random tiny model writes no
tool calls): the project's heuristic policy (memories from each chunk, answers from the shown views)
plus a scratchpad note, so that persistence of atoms and scratchpad has something to keep."""

from atommem_rl.policies.base import sections
from atommem_rl.policies.heuristic import HeuristicPolicy


class NotingPolicy(HeuristicPolicy):
    name = "noting"

    def act_one(self, key, observation, info):
        text = super().act_one(key, observation, info)
        chunk = sections(observation).get("chunk", "")
        if info.get("phase") == "chunks" and chunk:
            first = chunk.splitlines()[0][:60].replace('"', "'")
            text += f'\n<tool_call>\n{{"name": "write_scratchpad", "arguments": {{"content": "last read: {first}"}}}}\n</tool_call>'
        return text
