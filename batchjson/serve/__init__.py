"""`batchjson serve`: OpenAI's Batch API (/v1/files, /v1/batches) over batchjson jobs, for code written against the
hosted API that should run on its own GPUs with nothing changed but `base_url`.

    app.py      the HTTP routes, the API's objects and errors, the optional API key
    store.py    the durable state under --state DIR: files, batches, each batch's jobs (atomic writes)
    runner.py   the queue: a batch imported at creation, run as jobs one batch at a time, exported at its end

The server is for a trusted network: it binds 127.0.0.1 unless told otherwise, and its one credential is the
--api-key, which an address other than loopback needs (or --insecure, said in the server's first line).
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

from batchjson.errors import BatchjsonError


class ServeError(BatchjsonError):
    """The server cannot start as asked: a port in use, an address that is not this host's."""


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound here so that a port in use is a message, not uvicorn's exit."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ServeError(f"--host {host}: not an address of this host ({e.strerror}).") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port} ({e.strerror}): give another --port (or stop what "
                         "uses it).") from None
    sock.listen(128)
    return sock


def url(sock: socket.socket) -> str:
    """The base URL a client gives for the server on `sock`."""
    address, port = sock.getsockname()[:2]
    return f"http://{f'[{address}]' if ':' in address else address}:{port}/v1"


def open_to_others(sock: socket.socket) -> bool:
    """Whether hosts other than this one may reach `sock` (it is bound to an address other than loopback)."""
    return not ipaddress.ip_address(sock.getsockname()[0].split("%")[0]).is_loopback


def serve(state: str, host: str = "127.0.0.1", port: int = 8000, model: str = "default", api_key: str | None = None,
          max_requests: int | None = None, engine_factory=None, log_level: str = "info",
          insecure: bool = False) -> None:
    """Serve the Batch API from `state` until SIGTERM or Ctrl-C, saying first where. Batches left running by an
    earlier server on the same folder resume. A BatchjsonError when the folder or the address cannot be used, or
    when an address others reach has no `api_key` and `insecure` is not given."""
    import uvicorn

    from batchjson.serve.app import make_app
    from batchjson.serve.runner import MAX_REQUESTS, Runner
    from batchjson.serve.store import Store

    if model != "default" and not (Path(model) / "config.json").exists():
        raise ServeError(f"--model {model}: no Hugging Face model folder there (no config.json). Give a model folder, "
                         "or leave --model out for the embedded SmolLM2.")
    store = Store(state)
    try:
        sock = listen(host, port)
        if open_to_others(sock) and api_key is None:
            if not insecure:
                sock.close()
                raise ServeError(f"--host {host}: other hosts reach this address, and without --api-key anyone "
                                 "among them may submit batches and read their results. Give --api-key KEY (or "
                                 "BATCHJSON_API_KEY), or --insecure on a network you trust.")
            print(f"batchjson serve: --insecure: no API key on {host}, which other hosts reach: anyone among them "
                  "may submit batches and read their results.", flush=True)
        print(f"batchjson serve: listening on {url(sock)} (state {store.root})", flush=True)
        runner = Runner(store, model, engine_factory, max_requests or MAX_REQUESTS)
        app = make_app(store, runner, api_key)
        server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
        server.run(sockets=[sock])
    finally:
        store.close()


__all__ = ["ServeError", "serve"]
