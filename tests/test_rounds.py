"""Generation rounds on several ranks (training/rounds.py) and the step-wise trainers' guards that do not
need a model: vLLM server rounds with uneven prompt counts, the importance-sampling modes, refusals."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import REPO, free_port


def launch_ranks(script: str, *args: str, timeout: int = 120) -> list[dict]:
    """``accelerate launch`` of a tests/multirank driver on 2 gloo ranks; the JSON lines its ranks wrote to the
    file given as its first argument, sorted by rank."""
    out = Path(args[0])
    accelerate = Path(sys.executable).with_name("accelerate")
    res = subprocess.run([str(accelerate), "launch", "--config_file", str(REPO / "recipes/accelerate/cpu_2proc.yaml"),
                          "--main_process_port", str(free_port()), str(REPO / "tests/multirank" / script), *args],
                         cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["rank"])


def test_server_rounds_with_uneven_prompts_on_two_ranks(tmp_path):
    """Two gloo ranks send 3/1 and 1/4/2/2 prompts per round (rank 0 finishes first and drains): every
    completion comes back to the rank and position of its own prompt (TRL's server path sliced by
    ``process_index * len(prompts)`` and handed rank 1 rank 0's completions), both ranks take part in
    the same number of rounds (5: four with prompts, one that finds everyone idle), and the server is
    asked once per prompt, each with its own seed."""
    out = tmp_path / "ranks.jsonl"
    accelerate = Path(sys.executable).with_name("accelerate")
    res = subprocess.run([str(accelerate), "launch", "--config_file", str(REPO / "recipes/accelerate/cpu_2proc.yaml"),
                          "--main_process_port", str(free_port()), str(REPO / "tests/multirank/server_rounds.py"),
                          str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["mismatched"] == 0 for r in ranks)
    assert [r["rounds"] for r in ranks] == [5, 5]
    assert [r["prompts"] for r in ranks] == [4, 9]
    assert ranks[0]["server_calls"] == 13 and ranks[1]["server_calls"] == 0  # the main process asks


def test_a_failed_server_round_raises_on_every_rank(tmp_path):
    """The main process's requests fail in the second round (the scripted server raises a connection
    error): every rank raises ServerRoundError naming it, in the same round, at once. Before, rank 0 raised
    alone and rank 1 waited in the broadcast of the round's completions until gloo's 30-minute timeout
    (this test's 120 s limit would have cut it)."""
    ranks = launch_ranks("server_rounds.py", str(tmp_path / "ranks.jsonl"), "fail")
    assert [(r["rank"], r["round"], r["error"]) for r in ranks] == [(0, 1, "ServerRoundError"), (1, 1, "ServerRoundError")]
    assert all("ConnectionError: scripted: the server went away" in r["message"] for r in ranks)


def test_a_mismatched_completion_stops_every_rank(tmp_path):
    """The server answers rank 1's second-round prompts with completions of another prompt: the main
    process checks every rank's echoes and every rank raises CompletionMismatch in that round (before,
    rank 1 raised alone and rank 0 waited in the next round's gather)."""
    ranks = launch_ranks("server_rounds.py", str(tmp_path / "ranks.jsonl"), "mismatch")
    assert [(r["rank"], r["round"], r["error"]) for r in ranks] == [(0, 1, "CompletionMismatch"), (1, 1, "CompletionMismatch")]
    assert all("per rank: [0, 4]" in r["message"] for r in ranks)


def test_importance_sampling_modes_by_hand():
    from atommem_rl.training.grpo import importance_sampling_ratio

    old = torch.tensor([[0.0, -1.0, -2.0], [-1.0, -1.0, 0.0]])
    vllm = torch.tensor([[0.0, -2.0, -0.5], [-1.0, float("nan"), 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # per token: exp(old - vllm) on trained tokens, 1 elsewhere and where vLLM gave NaN
    tok = importance_sampling_ratio(old, vllm, mask, "token_truncate", None, 2.0)
    torch.testing.assert_close(tok, torch.tensor([[1.0, 2.0, 1.0], [1.0, 1.0, 1.0]]))  # e = 2.718 clamped to 2
    masked = importance_sampling_ratio(old, vllm, mask, "token_mask", 0.5, 2.0)
    torch.testing.assert_close(masked, torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]]))  # out of range: no loss
    seq = importance_sampling_ratio(old, vllm, mask, "sequence_truncate", 0.1, 5.0)
    assert seq.shape == (2, 1) and seq[:, 0].tolist() == pytest.approx([math.e, 1.0])
    assert importance_sampling_ratio(old, vllm, mask, "sequence_mask", None, 2.0)[:, 0].tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        importance_sampling_ratio(old, vllm, mask, "tokens", None, 2.0)


def test_unsupported_settings_are_refused_before_work():
    from types import SimpleNamespace

    from atommem_rl.training.grpo import refuse_unsupported

    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        refuse_unsupported(SimpleNamespace(vllm_importance_sampling_mode="per_token"))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        refuse_unsupported(SimpleNamespace(use_vllm=True, vllm_mode="colocate", vllm_tensor_parallel_size=2))
    refuse_unsupported(SimpleNamespace(use_vllm=True, vllm_mode="server", vllm_tensor_parallel_size=2))


def test_trainable_weights_are_fp32_unless_deepspeed():
    """A recipe's dtype bfloat16 under one process/DDP/FSDP would mean pure bf16 AdamW (lr 1e-6 updates
    round away): trainable weights load in fp32 there, and in the recipe's dtype under DeepSpeed."""
    from atommem_rl.models import trainable_dtype

    assert trainable_dtype("bfloat16", deepspeed=False) == "float32"
    assert trainable_dtype(None, deepspeed=False) == "float32"
    assert trainable_dtype("bfloat16", deepspeed=True) == "bfloat16"
    # bf16 AdamW loses the update that fp32 keeps
    w16, w32 = torch.tensor([0.02], dtype=torch.bfloat16), torch.tensor([0.02])
    assert torch.equal(w16 - 1e-6, w16) and not torch.equal(w32 - 1e-6, w32)


@pytest.mark.slow
def test_grpo_loads_a_bf16_checkpoint_in_fp32(tmp_path):
    from transformers import AutoModelForCausalLM

    from atommem_rl.models import tiny_model
    from atommem_rl.training.grpo import build_trainer

    from .test_grpo import small_config

    path = tiny_model(tmp_path / "tiny")
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(path)
    trainer = build_trainer(small_config(path, tmp_path / "out", synth_tasks=1, dtype="bfloat16"))
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}


def test_generation_autocast_wraps_generate_once_in_bf16(tmp_path):
    """bf16 through accelerate's autocast: one outer context around generate (weights cast once per call,
    not per step), the same tokens and scores as without it; fp32 and sharded runs get none."""
    from types import SimpleNamespace

    import torch
    from accelerate.utils import DistributedType
    from transformers import AutoModelForCausalLM

    from atommem_rl.models import tiny_model
    from atommem_rl.training.rounds import generation_autocast

    def trainer(precision, kind=DistributedType.NO):
        acc = SimpleNamespace(mixed_precision=precision, device=torch.device("cpu"), distributed_type=kind)
        return SimpleNamespace(accelerator=acc, use_vllm=False)

    with generation_autocast(trainer("bf16")):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    for t in (trainer("no"), trainer("bf16", DistributedType.FSDP), trainer("bf16", DistributedType.DEEPSPEED)):
        with generation_autocast(t):
            assert not torch.is_autocast_enabled("cpu")

    model = AutoModelForCausalLM.from_pretrained(tiny_model(tmp_path / "m"), dtype=torch.float32).eval()
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)  # as accelerate wraps it
    ids = torch.randint(10, 1000, (3, 20), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        plain = model.generate(input_ids=ids, **kw)
        with generation_autocast(trainer("bf16")):
            outer = model.generate(input_ids=ids, **kw)
    assert torch.equal(plain.sequences, outer.sequences)
    assert torch.equal(torch.stack(plain.scores), torch.stack(outer.scores))


class _FailingServer:
    """A scripted vLLM server (loopback): /health and /v1/models answer; /v1/completions fails with HTTP 500
    (``fail``) or holds the request for a minute before failing (``stall``)."""

    def __init__(self, mode: str):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, code, body):
                data = json.dumps(body).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (its timeout)
                    pass

            def do_GET(self):  # noqa: N802 - http.server API
                self._reply(200, {"data": [{"id": "scripted"}]})

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.requests += 1
                if mode == "stall":
                    import time

                    time.sleep(60)
                self._reply(500, {"error": "scripted failure"})

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("mode", ["fail", "stall"])
def test_server_failure_stops_busy_and_idle_ranks_alike(mode, tmp_path):
    """A vLLM server that fails or stalls while rank 0 runs an episode and rank 1 has none (it drains):
    both ranks stop with the same ServerRoundError naming the server and the step, within the request
    timeout times the tries (plus the start-up), after exactly 1 + retries tries of the round; no episode
    is recorded (before: the busy rank turned the failure into crashed episodes scored 0, retried them one
    by one, and the idle rank raised alone while the other waited; a stalled server blocked for good)."""
    server = _FailingServer(mode)
    try:
        ranks = launch_ranks("server_failure.py", str(tmp_path / "ranks.jsonl"), server.url, timeout=300)
    finally:
        server.close()
    assert [r["error"] for r in ranks] == ["ServerRoundError", "ServerRoundError"], ranks
    assert ranks[0]["message"] == ranks[1]["message"]
    assert server.url in ranks[0]["message"] and "global step 3" in ranks[0]["message"]
    assert "2 times" in ranks[0]["message"] and ("500" in ranks[0]["message"] or "Timeout" in ranks[0]["message"])
    assert [r["recorded"] for r in ranks] == [0, 0] and [r["crashed"] for r in ranks] == [0, 0]
    assert ranks[0]["rounds"] == ranks[1]["rounds"] == 1  # one round, tried twice on the main process
    assert server.requests == 2  # 1 + vllm_round_retries tries of the one prompt, no per-episode retries
    # timeout 2 s x 2 tries + 2 s backoff; the rest is the environment's start-up and the tokenizer
    assert max(r["seconds"] for r in ranks) < 60

