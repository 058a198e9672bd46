"""The HTTP API of ``atommem serve`` (FastAPI; the OpenAPI schema at /openapi.json, docs at /docs).

    POST   /sessions                      {"session": "alice"} (optional name)  -> 201 {"session"}
    GET    /sessions                                                             -> {"sessions": [...]}
    POST   /sessions/{id}/observe         {"text"} | {"documents": [...]} | {"messages": [{role, content}]}
                                          (+ optional "title", "date")        -> {"blocks", "steps", "memories"}
    POST   /sessions/{id}/ask             {"question"}                        -> {"answer", "read", "steps"}
    GET    /sessions/{id}/memories                                           -> {"memories", "scratchpad"}
    DELETE /sessions/{id}                                                    -> {"deleted": true}
    GET    /sessions/{id}/page[?q=...]    the memory page (atoms, roles, relations, fused views)
    GET    /health

Bad input never reaches the policy or the store and never gets a traceback: a body over the limit is
413, malformed JSON 400, a wrong type or unknown field 422, an unknown session 404, an existing one
409, each as one JSON line ``{"error": "..."}``; the store being unreachable is 503.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictStr, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from atommem_rl.memory.errors import StoreUnavailableError

from .page import memory_page
from .sessions import SessionError, Sessions, check_session_id, new_session_id

Text = Annotated[StrictStr, Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NewSession(_Strict):
    session: Text | None = None


class Document(_Strict):
    text: Text
    title: StrictStr | None = None


class Turn(_Strict):
    role: Text
    content: Text


class Observation(_Strict):
    text: Text | None = None
    documents: Annotated[list[Text | Document], Field(min_length=1)] | None = None
    messages: Annotated[list[Turn], Field(min_length=1)] | None = None
    title: StrictStr | None = None
    date: StrictStr | None = None

    @model_validator(mode="after")
    def _one_kind(self):
        given = [k for k in ("text", "documents", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of text, documents or messages")
        return self

    def content(self):
        if self.text is not None:
            return self.text
        if self.documents is not None:
            return [d if isinstance(d, str) else d.model_dump(exclude_none=True) for d in self.documents]
        return [t.model_dump() for t in self.messages]


class Question(_Strict):
    question: Annotated[StrictStr, Field(min_length=1, max_length=2000)]


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": " ".join(str(message).split())[:500]}, status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[int, str]:
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return 400, f"malformed JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    return 422, f"{where}: {first.get('msg')}"


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is refused with 413 before it is read
    whole (by its Content-Length, or while it streams in without one)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        too_big = _error(413, f"request body over {self.limit} bytes")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await too_big(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooBig()
            return message

        try:
            await self.app(scope, limited, send)
        except _TooBig:
            await too_big(scope, receive, send)


class _TooBig(Exception):
    pass


def create_app(sessions: Sessions, *, max_body: int = 1 << 20, title: str = "atommem serve") -> FastAPI:
    app = FastAPI(title=title, description=__doc__.split("\n\n")[0])

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _error(*_validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, exc.detail)

    @app.exception_handler(SessionError)
    async def _session(request: Request, exc: SessionError):
        return _error(exc.status, str(exc))

    @app.exception_handler(ValueError)
    async def _value(request: Request, exc: ValueError):  # an observation the environment cannot take
        return _error(400, str(exc))

    @app.exception_handler(StoreUnavailableError)
    async def _store(request: Request, exc: StoreUnavailableError):
        return _error(503, str(exc))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return _error(500, f"internal error ({type(exc).__name__})")

    async def run(kind: str, sid: str, payload=None):
        return await asyncio.wrap_future(sessions.submit(kind, check_session_id(sid), payload))

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True, **sessions.rounds}

    @app.post("/sessions", status_code=201)
    async def create(body: NewSession | None = None) -> dict:
        return await run("create", (body.session if body and body.session else None) or new_session_id())

    @app.get("/sessions")
    async def listing() -> dict:
        return {"sessions": await asyncio.to_thread(sessions.known)}

    @app.post("/sessions/{sid}/observe")
    async def observe(sid: str, body: Observation) -> dict:
        return await run("observe", sid, (body.content(), {"title": body.title, "date": body.date}))

    @app.post("/sessions/{sid}/ask")
    async def ask(sid: str, body: Question) -> dict:
        reply = await run("ask", sid, body.question)
        return {"answer": reply.answer, "read": reply.read, "steps": reply.steps}

    @app.get("/sessions/{sid}/memories")
    async def memories(sid: str) -> dict:
        return await run("memories", sid)

    @app.delete("/sessions/{sid}")
    async def delete(sid: str) -> dict:
        return await run("delete", sid)

    @app.get("/sessions/{sid}/page", response_class=HTMLResponse)
    async def page(sid: str, q: Annotated[str, Field(max_length=500)] = "") -> HTMLResponse:
        data = await run("memories", sid, {"query": q} if q else None)
        return HTMLResponse(memory_page(sid, data, q))

    app.add_middleware(BodyLimit, limit=max_body)
    return app

