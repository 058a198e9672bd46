"""Launched by tests/test_rounds.py under ``accelerate launch`` (2 gloo ranks): a vLLM server that fails (HTTP
500) or stalls (answers nothing for a minute) while rank 0 is busy with an episode (``run_rollouts`` with the
trainer's ``TrainerPolicy``, a real environment and tokenizer) and rank 1 has none (``drain``, as
``StepwiseGRPOTrainer._run_episodes`` does). The server is the test's scripted HTTP server, reached through TRL's
own ``VLLMClient.generate`` (the object is built without its constructor, which needs vLLM installed and a real
server's weight-sync endpoints); ``bound_server_calls`` gives its session the request timeout, as the trainer does.

    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml tests/multirank/server_failure.py OUT URL

Each rank appends one JSON line to OUT: the exception it stopped with, its message, the seconds it took, and the
episodes recorded (finished or crashed).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import requests  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from trl.generation.vllm_client import VLLMClient  # noqa: E402

from atommem_rl.models import base_tokenizer  # noqa: E402
from atommem_rl.rollout import run_rollouts  # noqa: E402
from atommem_rl.tasks.synth import generate_task  # noqa: E402
from atommem_rl.training.rounds import TrainerPolicy, bound_server_calls  # noqa: E402

TIMEOUT, RETRIES = 2.0, 1


def main(out: str, url: str) -> None:
    acc = Accelerator(cpu=True)
    rank = acc.process_index
    tok = base_tokenizer()
    client = VLLMClient.__new__(VLLMClient)
    client.session, client.base_url, client.model = requests.Session(), url, "scripted"
    bound_server_calls(client, TIMEOUT)
    vg = SimpleNamespace(vllm_client=client, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                         max_completion_length=16, logprobs=0, structured_outputs_regex=None, generation_kwargs={},
                         sync_weights=lambda: None)
    trainer = SimpleNamespace(
        accelerator=acc, use_vllm=True, vllm_generation=vg, processing_class=tok, _last_loaded_step=3,
        max_completion_length=vg.max_completion_length,
        args=SimpleNamespace(vllm_mode="server", vllm_request_timeout=TIMEOUT, vllm_round_retries=RETRIES),
        state=SimpleNamespace(global_step=3))
    policy = TrainerPolicy(trainer, seed=0)
    tasks = [generate_task(0, 0, docs=2, questions=1, confounders=0)] if rank == 0 else []
    recorded: list[dict] = []
    t0 = time.monotonic()
    try:
        run_rollouts(tasks, policy, {"tokenizer": tok, "embedder": "hashing", "chunk_tokens": 64,
                                     "max_prompt_tokens": 2048, "max_answer_steps": 1},
                     batch_size=1, seed=0, record_prompts=False, on_episode=recorded.append)
        policy.drain()
        result = {"error": None, "message": None}
    except Exception as exc:  # noqa: BLE001 - what each rank stopped with is the finding
        result = {"error": type(exc).__name__, "message": str(exc)}
    result.update(rank=rank, seconds=round(time.monotonic() - t0, 2), recorded=len(recorded),
                  crashed=sum(int(bool(r.get("crashed"))) for r in recorded), rounds=policy.rounds)
    with open(out, "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
