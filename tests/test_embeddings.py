"""Embedding functions: hashing (deterministic across processes), packaged MiniLM (real model,
offline), and the OpenAI-compatible client against a local /v1/embeddings server backed by MiniLM."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from atommem_rl.memory.embeddings import (
    HashingEmbedder,
    OpenAIEmbedder,
    SentenceTransformerEmbedder,
    make_embedder,
)
from atommem_rl.memory.errors import StoreUnavailableError
from atommem_rl.memory.store import AtomStore

from .conftest import REPO, JsonEndpoint


def test_hashing_is_deterministic_across_processes():
    texts = ["Caroline moved to Boston in May", "Melanie paints landscapes"]
    here = HashingEmbedder(64).embed(texts)
    code = ("import json; from atommem_rl.memory.embeddings import HashingEmbedder; "
            f"print(json.dumps(HashingEmbedder(64).embed({texts!r}).tolist()))")
    there = np.array(json.loads(subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                                               text=True, check=True).stdout))
    assert np.allclose(here, there)
    assert np.allclose(np.linalg.norm(here, axis=1), 1.0)
    sim = here @ HashingEmbedder(64).embed(["Caroline moved to Boston"]).T
    assert sim[0, 0] > sim[1, 0]


@pytest.fixture(scope="module")
def minilm():
    return SentenceTransformerEmbedder()


def test_packaged_minilm_gives_real_semantic_embeddings(minilm):
    vecs = minilm.embed(["A dog is playing in the park", "A puppy plays outside", "Quarterly tax filing deadline"])
    assert vecs.shape == (3, 384) and vecs.dtype == np.float32
    assert vecs[0] @ vecs[1] > 0.5 > vecs[0] @ vecs[2]
    assert make_embedder("minilm").get_config()["model_path"] == minilm.model_path
    assert isinstance(make_embedder("hashing:32"), HashingEmbedder) and make_embedder("hashing:32").dim == 32
    with pytest.raises(ValueError):
        make_embedder("word2vec")


def test_store_with_minilm_reopens_with_its_embedder(minilm, namespace):
    store = AtomStore(namespace, embedder=minilm)
    store.create("Melanie ran a charity race for mental health")
    again = AtomStore.open(namespace, client=store.client)
    assert isinstance(again.embedder, SentenceTransformerEmbedder)
    assert again.read("What did Melanie run for?", k=1)[0].atom.text.startswith("Melanie ran")


def _embeddings_reply(model):
    """An OpenAI-compatible /v1/embeddings endpoint backed by a real model; data comes back reversed
    (the client must restore order by index) and a wrong key is refused."""

    def reply(path, headers, body):
        if path != "/v1/embeddings" or headers.get("Authorization") != "Bearer test-key":
            return 401, {"error": "unauthorized"}
        vecs = model.embed(body["input"])
        data = [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vecs)]
        return 200, {"object": "list", "data": data[::-1], "model": body["model"]}

    return reply


def test_openai_compatible_endpoint(minilm, monkeypatch, namespace):
    server = JsonEndpoint(_embeddings_reply(minilm))
    try:
        monkeypatch.setenv("ATOMMEM_TEST_KEY", "test-key")
        url = server.url
        remote = OpenAIEmbedder(url, "all-MiniLM-L6-v2", api_key_env="ATOMMEM_TEST_KEY", batch_size=2)
        texts = ["one fact", "another fact", "a third fact"]
        assert np.allclose(remote.embed(texts), minilm.embed(texts), atol=1e-5)  # order restored by index
        assert "test-key" not in json.dumps(remote.get_config())  # the key is never persisted
        store = AtomStore(namespace, embedder=remote)
        store.create("Caroline researched adoption agencies")
        assert AtomStore.open(namespace, client=store.client).embedder.get_config()["base_url"] == url
        monkeypatch.setenv("ATOMMEM_TEST_KEY", "wrong")
        with pytest.raises(StoreUnavailableError):
            remote.embed(["x"])
    finally:
        server.close()
