"""Shared fixtures: real Chroma in its three modes (no mocks anywhere).

``chroma_server`` starts ``chroma run --path DIR --host 127.0.0.1 --port P`` as a subprocess, waits
for its heartbeat and stops it afterwards; tests that need a server in another state (killed,
restarted) use :class:`ChromaServer` directly.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")

REPO = Path(__file__).resolve().parents[1]
# the benchmark files shipped with the package (atommem_rl/data/benchmarks), never a folder beside the repository
DATA = REPO / "atommem_rl" / "data" / "benchmarks"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chroma_executable() -> str:
    exe = Path(sys.executable).with_name("chroma")
    return str(exe) if exe.exists() else (shutil.which("chroma") or "chroma")


class ChromaServer:
    """A real ``chroma run`` process on 127.0.0.1 with a persistent path."""

    def __init__(self, path: Path, port: int | None = None):
        self.path, self.port = Path(path), port or free_port()
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> "ChromaServer":
        log = open(self.path.parent / f"chroma-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [chroma_executable(), "run", "--path", str(self.path), "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        import httpx

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chroma run exited with {self.proc.returncode}; see {log.name}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/api/v2/heartbeat", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"chroma run did not answer on port {self.port} within {timeout}s")

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="session")
def chroma_server(tmp_path_factory):
    server = ChromaServer(tmp_path_factory.mktemp("chroma-server") / "db").start()
    yield server
    server.stop()


_counter = itertools.count()


@pytest.fixture
def namespace() -> str:
    """A namespace no other test uses (EphemeralClients in one process share one database)."""
    return f"t{next(_counter)}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def store(namespace):
    from atommem_rl.memory.embeddings import HashingEmbedder
    from atommem_rl.memory.store import AtomStore

    s = AtomStore(namespace, embedder=HashingEmbedder(128))
    yield s
    try:
        s.drop()
    except Exception:
        pass


def require(available: bool, why: str) -> None:
    """Skip a test whose real component (a browser, a Slurm cluster) is missing, except under
    ATOMMEM_STRICT=1 (CI), where a missing component is a failure: CI must exercise every one."""
    if available:
        return
    if os.environ.get("ATOMMEM_STRICT") == "1":
        pytest.fail(f"required component missing under ATOMMEM_STRICT=1: {why}")
    pytest.skip(why)


class JsonEndpoint:
    """A real HTTP server on 127.0.0.1 whose POST replies come from ``reply(path, headers, body)``,
    which returns (status, JSON-able body). Tests use it for OpenAI-compatible endpoints whose
    model output they script (chat completions, embeddings), as TRL's tests script generations."""

    def __init__(self, reply):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server API
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                status, out = reply(self.path, self.headers, body)
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "JsonEndpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def chat_reply(content: str, prompt_tokens: int = 0, completion_tokens: int = 0) -> tuple[int, dict]:
    """An OpenAI chat-completions response body with ``content`` and usage counts."""
    return 200, {"choices": [{"message": {"content": content}}],
                 "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}}


def tiny_agent_checkpoint(folder: Path) -> Path:
    """A tiny Qwen3 checkpoint with the environment it 'trained' in (question-hidden, short chunks), as a
    trained agent checkpoint carries it: what MemoryAgent and atommem serve load in their tests."""
    from atommem_rl.models import tiny_model
    from atommem_rl.training.checkpoint_env import write_env

    ckpt = tiny_model(folder / "ckpt", arch="qwen3", hidden_size=32, heads=2, kv_heads=1, intermediate_size=64)
    write_env(ckpt, {"questions": "hidden", "chunk_tokens": 96, "max_prompt_tokens": 2048}, "sft")
    return ckpt

