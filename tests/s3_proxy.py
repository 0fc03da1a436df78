"""A fault-injecting HTTP proxy on loopback, in front of the test S3 server (tests/s3_server.py).

Each request is forwarded to the server, or, at `rate`, answered with a fault: a 503 SlowDown or a 500
InternalError (S3's XML error bodies), a connection reset before any answer or halfway through the response
body (after the server has done the request: a PUT, copy or delete has happened, the client cannot know), or a
slow answer. The proxy counts the requests it sees (by S3 operation) and the faults it injects (by kind).
The client signs the Host header: it is forwarded as the client sent it.
"""

from __future__ import annotations

import collections
import http.client
import random
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

KINDS = ("503", "500", "reset", "cut", "slow")
ERRORS = {"503": ("Service Unavailable", "SlowDown", "Please reduce your request rate."),
          "500": ("Internal Server Error", "InternalError", "We encountered an internal error. Please try again.")}


def operation(method: str, target: str) -> str:
    """What an S3 request does, from its method and query: GET, LIST, HEAD, PUT, COPY, DELETE, POST."""
    path, _, query = target.partition("?")
    if method == "GET" and ("list-type" in query or path.count("/") <= 1 and "prefix" in query):
        return "LIST"
    return method


class FaultProxy:
    """`with FaultProxy(upstream, rate=0.1) as proxy:` ... `proxy.endpoint` is its host:port. Change `rate`,
    `kinds` or `only` (operations to fault, None for all) at any time; `faults`, `requests` and `paths` count."""

    def __init__(self, upstream: str, rate: float = 0.0, kinds=KINDS, seed: int = 0, slow_s: float = 0.4,
                 only: set[str] | None = None, start_after: int = 0):
        self.start_after = start_after  # requests forwarded untouched before the first fault
        self.upstream, self.rate, self.kinds, self.slow_s, self.only = upstream, rate, tuple(kinds), slow_s, only
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.faults: collections.Counter = collections.Counter()
        self.requests: collections.Counter = collections.Counter()
        self.paths: collections.Counter = collections.Counter()  # (operation, /bucket/key) -> requests
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            upstream_conn: http.client.HTTPConnection | None = None

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    raw = bytearray()
                    while True:
                        line = self.rfile.readline()
                        raw += line
                        size = int(line.split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while True:  # trailers, up to the empty line
                                trailer = self.rfile.readline()
                                raw += trailer
                                if trailer in (b"\r\n", b"\n", b""):
                                    return bytes(raw)
                        raw += self.rfile.read(size + 2)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _reset(self) -> None:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                try:
                    self.wfile.flush()
                except OSError:
                    pass
                self.connection.close()

            def _forward(self, body: bytes):
                for attempt in (0, 1):  # a kept-alive connection the server closed meanwhile: once more
                    if self.upstream_conn is None:
                        self.upstream_conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                    conn = self.upstream_conn
                    try:
                        conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                        for name, value in self.headers.items():
                            if name.lower() not in ("expect", "connection"):
                                conn.putheader(name, value)
                        conn.endheaders(body or None)
                        response = conn.getresponse()
                        data = response.read()
                        return response, data
                    except (http.client.RemoteDisconnected, ConnectionError, BrokenPipeError):
                        conn.close()
                        self.upstream_conn = None
                        if attempt:
                            raise

            def _handle(self):
                body = self._body()
                op = operation(self.command, self.path)
                with proxy.lock:
                    proxy.requests[op] += 1
                    proxy.paths[op, self.path.partition("?")[0]] += 1
                    fault = None
                    if proxy.rate and sum(proxy.requests.values()) > proxy.start_after and (proxy.only is None or op in proxy.only) and proxy.random.random() < proxy.rate:
                        fault = proxy.random.choice(proxy.kinds)
                    if fault:
                        proxy.faults[fault] += 1
                if fault in ERRORS:
                    status, code, message = ERRORS[fault]
                    xml = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}'
                           f'</Message><RequestId>fault-proxy</RequestId></Error>').encode()
                    self.send_response(int(fault), status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(xml)))
                    self.end_headers()
                    self.wfile.write(xml)
                    return
                if fault == "reset" and self.command in ("GET", "HEAD"):
                    self._reset()  # before the server sees it
                    return
                response, data = self._forward(body)
                if fault == "slow":
                    time.sleep(proxy.slow_s)
                self.send_response(response.status, response.reason)
                for name, value in response.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                length = response.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                if length is not None:
                    self.send_header("Content-Length", length)
                self.end_headers()
                if fault in ("reset", "cut"):  # a reset: the server did the request, its answer is lost
                    if fault == "cut" and self.command != "HEAD":
                        self.wfile.write(data[:len(data) // 2])
                    self._reset()
                    return
                if self.command != "HEAD":
                    self.wfile.write(data)

            def do_request(self):
                try:
                    self._handle()
                except (ConnectionError, BrokenPipeError, OSError):
                    self.close_connection = True

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_request

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="fault-proxy", daemon=True)

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def injected(self) -> int:
        return sum(self.faults.values())
