"""Keeps a known warning flood of vLLM's engine processes out of the user's terminal and log: lines of the process's
stderr that match FLOODS are counted, not printed; everything else passes through unchanged.

Why: under speculation + a grammar, xgrammar's C++ matcher logs "The matcher has terminated after accepting the stop
token, but is trying to accept new token" for each draft token after a row's end (thousands of lines per run), from
C++ straight to file descriptor 2, so no Python logging setting reaches it. The engine process's fd 2 becomes a pipe
that a thread reads and filters into the real stderr; at exit the thread drains the pipe and prints one line with
what it hid.
"""

from __future__ import annotations

import atexit
import os
import threading

FLOODS = (b"The matcher has terminated after accepting the stop token",)
ENV_RAW = "BATCHJSON_ENGINE_STDERR"  # "raw": leave the engine processes' stderr alone


def quiet_floods(floods: tuple[bytes, ...] = FLOODS) -> None:
    """Filter this process's stderr (fd 2) from now on; idempotent, never raises."""
    global _INSTALLED
    if _INSTALLED or os.environ.get(ENV_RAW) == "raw":
        return
    try:
        real = os.dup(2)
        r, w = os.pipe()
        os.dup2(w, 2)
        os.close(w)
    except OSError:
        return
    _INSTALLED = True
    hidden = [0]

    def pump() -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(r, 1 << 16)
            except OSError:
                return
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            kept = [line for line in lines if not any(f in line for f in floods)]
            hidden[0] += len(lines) - len(kept)
            _write(real, b"\n".join(kept) + b"\n" if kept else b"")
        _write(real, pending + b"\n" if pending else b"")

    thread = threading.Thread(target=pump, name="batchjson-stderr", daemon=True)
    thread.start()

    def drain() -> None:
        try:
            os.dup2(real, 2)  # the pipe's last writer in this process goes: the thread reads to its end
        except OSError:
            return
        thread.join(timeout=2)
        if hidden[0]:
            os.write(real, f"batchjson: hid {hidden[0]} repeated grammar warning line(s) of this engine process "
                           f"(\"{floods[0].decode()}...\")\n".encode())

    atexit.register(drain)


_INSTALLED = False


def _write(fd: int, data: bytes) -> None:
    """Write to the real stderr; if it is gone, drop the data but keep draining the pipe, so that no writer to fd 2
    ever blocks on a full pipe."""
    if data:
        try:
            os.write(fd, data)
        except OSError:
            pass
