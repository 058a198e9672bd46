"""The store on real Chroma in all three modes: in-memory, a persistent path reopened by another
process, and a ``chroma run`` server on 127.0.0.1 started by the fixture."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from atommem_rl.memory.atom import Role
from atommem_rl.memory.chroma_clients import make_client
from atommem_rl.memory.embeddings import HashingEmbedder
from atommem_rl.memory.errors import StoreUnavailableError
from atommem_rl.memory.store import AtomStore

from .conftest import REPO, ChromaServer, free_port


def populate(store: AtomStore) -> None:
    old = store.create("Ann lives in Oslo", participants=["Ann"], time="2022-01-01")
    new = store.create("Ann lives in Bergen", participants=["Ann"], time="2023-04-01")
    store.relate(new.id, old.id, "conflict")
    store.update(new.id, "Ann lives in Bergen, near the harbour")


READ_BACK = textwrap.dedent(
    """
    import json, sys
    import chromadb
    from atommem_rl.memory.chroma_clients import make_client
    from atommem_rl.memory.store import AtomStore, COLLECTION_PREFIX
    kind, arg, ns = sys.argv[1], sys.argv[2], sys.argv[3]
    client = make_client("persistent", path=arg) if kind == "persistent" else make_client("http", port=int(arg))
    # no embedder passed: it is rebuilt from the collection's persisted, registered config
    store = AtomStore.open(ns, client=client)
    print(json.dumps({"ef": type(store.embedder).__name__, "dim": store.embedder.dim,
                      "atoms": store.snapshot(),
                      "read": [v.text for v in store.read("Where does Ann live?", k=5)]}))
    """
)


def read_in_new_process(kind: str, arg: str, ns: str) -> dict:
    out = subprocess.run([sys.executable, "-c", READ_BACK, kind, arg, ns], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def expected_after_populate(result: dict) -> None:
    old, new = result["atoms"]  # in creation order
    assert old["role"] == Role.EVIDENCE.value and new["role"] == Role.PRIMARY.value
    assert new["history"][0]["text"] == "Ann lives in Bergen"
    assert new["relations"] == {old["id"]: "conflict"}
    assert result["read"] == [
        "Ann lives in Bergen, near the harbour [previously: Ann lives in Bergen; Ann lives in Oslo (until 2023-04-01)]"
    ]
    assert result["ef"] == "HashingEmbedder" and result.get("dim", 96) == 96


def test_in_memory(namespace):
    store = AtomStore(namespace, client=make_client("memory"), embedder=HashingEmbedder(96))
    populate(store)
    snap = {"atoms": store.snapshot(), "read": [v.text for v in store.read("Where does Ann live?", k=5)],
            "ef": "HashingEmbedder"}
    expected_after_populate(snap)


def test_persistent_path_reopened_by_another_process(tmp_path, namespace):
    writer = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(
            """
            import sys
            from atommem_rl.memory.chroma_clients import make_client
            from atommem_rl.memory.embeddings import HashingEmbedder
            from atommem_rl.memory.store import AtomStore
            from tests.test_chroma_modes import populate
            populate(AtomStore(sys.argv[2], client=make_client("persistent", path=sys.argv[1]),
                               embedder=HashingEmbedder(96)))
            """), str(tmp_path / "db"), namespace],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert writer.returncode == 0, writer.stderr
    expected_after_populate(read_in_new_process("persistent", str(tmp_path / "db"), namespace))


def test_chroma_server(chroma_server, namespace):
    client = make_client("http", port=chroma_server.port)
    store = AtomStore(namespace, client=client, embedder=HashingEmbedder(96))
    populate(store)
    expected_after_populate(read_in_new_process("http", str(chroma_server.port), namespace))
    other = AtomStore(namespace + "-other", client=client, embedder=HashingEmbedder(96))
    assert len(other) == 0  # namespaces isolated on the server too


def test_unreachable_server_is_a_clear_error():
    port = free_port()
    with pytest.raises(StoreUnavailableError, match=f"127.0.0.1:{port}"):
        make_client("http", port=port)


def test_server_going_away_mid_episode(tmp_path, namespace):
    server = ChromaServer(tmp_path / "db").start()
    try:
        store = AtomStore(namespace, client=make_client("http", port=server.port), embedder=HashingEmbedder(96))
        store.create("acknowledged before the crash")
        server.kill()
        with pytest.raises(StoreUnavailableError):
            store.create("written while the server is down")
        assert [a.text for a in store.atoms()] == ["acknowledged before the crash"]  # mirror unchanged
        server.start()
        again = AtomStore(namespace, client=make_client("http", port=server.port), embedder=HashingEmbedder(96))
        assert [a.text for a in again.atoms()] == ["acknowledged before the crash"]
    finally:
        server.stop()
