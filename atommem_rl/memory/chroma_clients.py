"""Chroma clients for the three deployment modes, behind one constructor, and how their failures
map to the store's errors.

    memory      chromadb.EphemeralClient: in-process, nothing on disk (the default). Every
                EphemeralClient in one process shares one database; namespaces keep episodes apart.
    persistent  chromadb.PersistentClient(path): one process at a time may own a path.
    http        chromadb.HttpClient to a ``chroma run --path DIR --host 127.0.0.1 --port P`` server:
                the mode for many processes (rollout workers) sharing one store.

(Model engines, HF/vLLM/OpenAI-compatible, are another thing: ``atommem_rl/inference/chat_backends.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass

import chromadb
from chromadb.config import Settings
from chromadb.errors import ChromaError

from .errors import MemoryStoreError, StoreUnavailableError


def _settings() -> Settings:
    # a fresh object per client: HttpClient writes its host and port into the settings it is given
    return Settings(anonymized_telemetry=False, allow_reset=False)


@dataclass(frozen=True)
class BackendConfig:
    kind: str = "memory"  # memory | persistent | http
    path: str | None = None  # persistent
    host: str = "127.0.0.1"  # http
    port: int = 8000  # http

    def __post_init__(self):
        if self.kind not in ("memory", "persistent", "http"):
            raise ValueError(f"unknown Chroma backend {self.kind!r}; expected memory, persistent or http")
        if self.kind == "persistent" and not self.path:
            raise ValueError("the persistent backend needs a path")


def make_client(config: BackendConfig | str = "memory", **kwargs) -> "chromadb.api.ClientAPI":
    """A Chroma client for ``config`` (a BackendConfig, or its kind with fields as keywords).

    An http server that cannot be reached raises StoreUnavailableError naming the address.
    """
    if isinstance(config, str):
        config = BackendConfig(kind=config, **kwargs)
    if config.kind == "memory":
        return chromadb.EphemeralClient(settings=_settings())
    if config.kind == "persistent":
        return chromadb.PersistentClient(path=config.path, settings=_settings())
    url = f"http://{config.host}:{config.port}"
    try:
        client = chromadb.HttpClient(host=config.host, port=config.port, settings=_settings())
        client.heartbeat()
    except Exception as exc:  # chromadb raises ValueError/httpx errors depending on where it fails
        raise StoreUnavailableError(
            f"cannot reach the Chroma server at {url} ({exc}); "
            f"start one with: chroma run --path DIR --host {config.host} --port {config.port}",
            url=url, operation="connecting",
        ) from exc
    return client


def parse_url(url: str) -> BackendConfig:
    """``http://HOST:PORT`` (a ``chroma run`` server) -> BackendConfig; anything else is an error."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"Chroma server URL {url!r} must look like http://127.0.0.1:8000")
    return BackendConfig(kind="http", host=parts.hostname, port=parts.port or 8000)


def address(client) -> str:
    """Where ``client`` sends its calls: ``http://host:port`` for an HttpClient, ``in-process``
    for the in-memory and persistent clients (named in StoreUnavailableError messages)."""
    try:
        s = client.get_settings()
    except Exception:  # not a Chroma client we know: say so rather than fail while reporting a failure
        return "unknown"
    if "fastapi" in str(getattr(s, "chroma_api_impl", "")).lower() and s.chroma_server_host:
        return f"http://{s.chroma_server_host}:{s.chroma_server_http_port}"
    return "in-process"


def is_unavailable(exc: BaseException) -> bool:
    """Is ``exc`` the transport failing (server down, connection refused or dropped mid-request,
    timeout) rather than Chroma rejecting the call? httpx's TransportError covers refused and
    dropped connections (``RemoteProtocolError: Server disconnected`` is not a ConnectError)."""
    import httpx

    if isinstance(exc, (httpx.TransportError, ConnectionError, TimeoutError, OSError)):
        return True
    name = type(exc).__name__
    return "Connect" in name or "Timeout" in name


def translate_error(exc: Exception, what: str, client) -> MemoryStoreError:
    """The store's documented error for ``exc``, raised by Chroma or its transport during ``what``:
    StoreUnavailableError (naming the server) when the transport failed, MemoryStoreError when
    Chroma rejected the call."""
    if is_unavailable(exc):
        url = address(client)
        return StoreUnavailableError(f"Chroma server {url} unreachable during {what}: {type(exc).__name__}: {exc}",
                                     url=url, operation=what)
    if isinstance(exc, (ChromaError, ValueError, TypeError)):
        return MemoryStoreError(f"Chroma rejected {what}: {exc}")
    return MemoryStoreError(f"Chroma rejected {what}: {type(exc).__name__}: {exc}")


def is_up(client) -> bool:
    """One heartbeat: does the server answer now? (Always true for in-process clients.)"""
    try:
        client.heartbeat()
        return True
    except Exception:  # any failure means "not now"; the caller backs off and asks again
        return False
