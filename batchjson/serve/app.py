"""The HTTP face of `batchjson serve`: OpenAI's /v1/files and /v1/batches routes, their objects and their errors.

Every refusal is the Batch API's error object, `{"error": {"message", "type", "param", "code"}}`, with its status:
400 for a bad request (the message names the line and field of a refused request), 401 for a missing or wrong API
key, 404 for an unknown id or route. A bug is a 500 with a short message; its traceback goes to the server's log,
never to the client.
"""

from __future__ import annotations

import hmac
import logging

import orjson
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from starlette.exceptions import HTTPException

from batchjson.serve.runner import BadRequest, Runner
from batchjson.serve.store import NotFound, Store

MAX_FILE_BYTES = 200 * 1024 * 1024  # an upload: the Batch API's own limit on a batch's input file
SHOWN = 10  # refused lines named in an upload's error
log = logging.getLogger("batchjson.serve")


def error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status)


def check_upload(path) -> None:
    """Refuse (BadRequest, naming lines and fields) a batch input whose lines are not Batch requests. Only each
    line alone is checked here; a batch's creation checks the file as a whole (schemas, duplicate custom_ids)."""
    from batchjson.openai_batch.requests import Refused, read_requests

    problems, count, total = [], 0, 0
    with open(path, "rb") as f:
        for number, parsed in read_requests(f):
            total += 1
            if isinstance(parsed, Refused):
                count += 1
                if len(problems) < SHOWN:
                    problems.append(f"line {number}: {parsed.field + ': ' if parsed.field else ''}{parsed}")
    if count:
        more = f"\n  ... and {count - len(problems)} more refused lines" if count > len(problems) else ""
        raise BadRequest(f"{count} line(s) of the file are not Batch requests batchjson answers, so it was not "
                         "stored:\n  " + "\n  ".join(problems) + more, "file", "invalid_file")
    if not total:
        raise BadRequest("The file holds no request: a batch's input is JSONL, one request per line.", "file",
                         "invalid_file")


def _page(objs: list[dict], limit: int, after: str | None) -> dict:
    """A list page as the API's cursor pagination reads it: objects after the id `after`, `limit` of them."""
    if after is not None:
        ids = [o["id"] for o in objs]
        objs = objs[ids.index(after) + 1:] if after in ids else []
    page = objs[:max(1, limit)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(objs) > len(page)}


def make_app(store: Store, runner: Runner, api_key: str | None = None) -> FastAPI:
    """The server's app over `store`, its batches run by `runner` (started and stopped with the app)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        runner.start()
        yield
        runner.stop()

    app = FastAPI(title="batchjson serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error(401, "Incorrect API key provided: give the server's --api-key as a Bearer token.",
                             code="invalid_api_key")
        return await call_next(request)

    @app.exception_handler(BadRequest)
    async def bad_request(request, e: BadRequest):
        return error(e.status, str(e), param=e.param, code=e.code)

    @app.exception_handler(NotFound)
    async def not_found(request, e: NotFound):
        kind = "Batch" if str(e).startswith("batch") else "File"
        return error(404, f"No such {kind} object: {e}", param="id")

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error(400, f"{where or 'request'}: {first.get('msg', 'invalid request')}", param=where)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        if e.status_code == 404:
            return error(404, f"Invalid URL ({request.method} {request.url.path})")
        return error(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def bug(request, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return error(500, "The server had an error while processing your request (see its log).", "server_error")

    @app.post("/v1/files")
    def upload(file: UploadFile = File(...), purpose: str = Form(...)):
        if purpose != "batch":
            raise BadRequest(f"purpose must be batch: this server runs batches, got {purpose!r}.", "purpose")
        if file.size is not None and file.size > MAX_FILE_BYTES:
            raise BadRequest(f"The file is {file.size} bytes; a batch's input may be at most {MAX_FILE_BYTES} "
                             "bytes (200 MB).", "file", "file_too_large")
        return store.add_file(file.file, file.filename or "upload.jsonl", purpose, check=check_upload)

    @app.get("/v1/files")
    def list_files(purpose: str | None = None, limit: int = 10000, after: str | None = None, order: str = "desc"):
        files = [f for f in store.files() if purpose is None or f["purpose"] == purpose]
        return _page(files if order == "desc" else files[::-1], limit, after)

    @app.get("/v1/files/{file_id}")
    def retrieve_file(file_id: str):
        return store.file(file_id)

    @app.get("/v1/files/{file_id}/content")
    def file_content(file_id: str):
        return FileResponse(store.content(file_id), media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    def delete_file(file_id: str):
        store.delete_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as e:
            raise BadRequest(f"The body is not JSON ({e}).") from None
        from starlette.concurrency import run_in_threadpool

        return await run_in_threadpool(runner.create, body)  # the import reads the file: off the event loop

    @app.get("/v1/batches")
    def list_batches(limit: int = 20, after: str | None = None):
        return _page([runner.retrieve(b["id"]) if b["status"] == "in_progress" else b for b in store.batches()],
                     limit, after)

    @app.get("/v1/batches/{batch_id}")
    def retrieve_batch(batch_id: str):
        return runner.retrieve(batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str):
        return runner.cancel(batch_id)

    return app
