"""Launched by tests/test_rounds.py under ``accelerate launch`` (2 gloo ranks): generation rounds in vLLM
server mode with a different number of prompts per rank and per round, through the real collectives.

The vLLM server is scripted (a test must script the model's output to check which prompt a completion
belongs to): its completion of a prompt is the prompt's last two tokens and the seed's low byte, and it
echoes the prompt ids, as vLLM's /v1/completions does. Writes one JSON line per rank to argv[1].
With argv[2] == "fail" the server refuses the second round's requests (a connection error), and each rank
writes the error it raised instead; with "mismatch" it answers rank 1's second-round prompts as other prompts.
"""

import json
import sys
import threading
from types import SimpleNamespace

from accelerate import Accelerator

from atommem_rl.training.rounds import TrainerPolicy


class ScriptedServer:
    def __init__(self, fail_round: int | None = None, mismatch_round: int | None = None):
        self.calls = 0
        self.fail_round = fail_round
        self.mismatch_round = mismatch_round
        self.lock = threading.Lock()

    def generate(self, prompts, generation_kwargs=None, **params):
        with self.lock:
            self.calls += 1
        seed = generation_kwargs["seed"]
        if self.fail_round is not None and (seed % 1000) // 10 == self.fail_round:  # the seeds below hold the round
            raise ConnectionError("scripted: the server went away")
        if self.mismatch_round is not None and seed // 1000 == 1 and (seed % 1000) // 10 == self.mismatch_round:
            prompts = [[9, 9, 9] for _ in prompts]  # rank 1's prompts answered as another prompt's
        return {"prompt_ids": [list(p) for p in prompts], "completion_ids": [[p[-2], p[-1], seed % 256] for p in prompts],
                "logprobs": [[[-0.5]] * 3 for _ in prompts]}


def main(out: str, mode: str = "") -> None:
    acc = Accelerator(cpu=True)
    rank = acc.process_index
    server = ScriptedServer(fail_round=1 if mode == "fail" else None, mismatch_round=1 if mode == "mismatch" else None)
    vg = SimpleNamespace(vllm_client=server, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                         max_completion_length=8, logprobs=0, structured_outputs_regex=None, generation_kwargs={},
                         sync_weights=lambda: None)
    trainer = SimpleNamespace(accelerator=acc, use_vllm=True, args=SimpleNamespace(vllm_mode="server"),
                              vllm_generation=vg, state=SimpleNamespace(global_step=0), _last_loaded_step=0,
                              processing_class=SimpleNamespace(eos_token_id=0))
    policy = TrainerPolicy(trainer)
    # rank 0 has 3 prompts, then 1, then none; rank 1 has 1, then 4, then 2, then 2 (it finishes later)
    plan = {0: [3, 1], 1: [1, 4, 2, 2]}[rank]
    mismatched = 0
    for r, n in enumerate(plan):
        prompts = [[rank + 1, 100 * r + i, 7 * i + rank] for i in range(n)]
        seeds = [1000 * rank + 10 * r + i for i in range(n)]
        if mode in ("fail", "mismatch"):
            try:
                policy._round(prompts, seeds)
            except Exception as exc:
                with open(out, "a") as f:
                    f.write(json.dumps({"rank": rank, "round": r, "error": type(exc).__name__, "message": str(exc)}) + "\n")
                break  # every rank stops in the same round
            continue
        completions, logprobs, busy = policy._round(prompts, seeds)
        assert busy and len(completions) == n and len(logprobs) == n
        mismatched += sum(c != [p[-2], p[-1], s % 256] for c, p, s in zip(completions, prompts, seeds))
    if mode in ("fail", "mismatch"):
        _close(acc)
        return
    policy.drain()
    with open(out, "a") as f:
        f.write(json.dumps({"rank": rank, "rounds": policy.rounds, "mismatched": mismatched,
                            "server_calls": server.calls, "prompts": policy.generated_prompts}) + "\n")
    _close(acc)


def _close(acc) -> None:
    # left to interpreter exit, a gloo rank sometimes aborts after finishing (as the CLI, destroy it)
    acc.wait_for_everyone()
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
