"""The reaper: a small process beside each process that starts engines (a run, `serve`, a local replica, a Ray
actor), which kills the engine processes it started once it dies, however it dies.

plugin.py ties an engine process to its runner with a parent-death signal, but only once vLLM has loaded the plugin
there, after its start-up handshake: an engine core whose runner was SIGKILLed while it imported vLLM waited on the
handshake for ever, holding its memory (the card's, on a GPU). So `guard()`, around an engine's start, starts this
reaper (once per process), and marks the process's environment (BATCHJSON_RUNNER_PID), which every process it spawns
inherits (vLLM's engine core on CPU, a replica, multiprocessing's helpers), from their first instant. The reaper
waits on the runner's death (a pidfd: at once); then every process of this user whose environment names the runner,
and their children, is killed (SIGKILL), three times over a second (a child between its fork and exec at the
death).
A process forked rather than spawned (vLLM's engine core on CUDA) starts as a copy of the runner and shows the
runner's environment at its own start, without the mark: forked inside `guard()`, it gets the parent-death signal
in the first Python code it runs (an at-fork hook).

Linux only (elsewhere `guard()` only marks the environment).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

ENV = "BATCHJSON_RUNNER_PID"  # the pid of the process whose death ends the processes that carry it
PR_SET_PDEATHSIG = 1
SWEEPS = 3  # scans for what the runner left, 0.5 s apart
_guarded: int | None = None  # the pid of this process once its reaper runs (a forked child is not guarded)
_reaper: subprocess.Popen | None = None  # ... and its reaper
_forker: int | None = None  # the process that forks, seen from its child
_tying = 0  # inside how many `guard()` blocks this process is: a child forked then dies with it


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """Around the start of engine processes (or replicas): every process this one spawns from now on dies with it,
    however it dies (the environment's mark, the reaper), and every process it forks inside the block too (the
    parent-death signal). The reaper is started once per process (a few milliseconds)."""
    global _tying
    _start_reaper()
    _tying += 1
    try:
        yield
    finally:
        _tying -= 1


def _start_reaper() -> None:
    global _guarded, _reaper
    pid = os.getpid()
    os.environ[ENV] = str(pid)
    if _guarded == pid or not sys.platform.startswith("linux"):
        return
    if _guarded is None:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _guarded = pid
    env = {k: v for k, v in os.environ.items() if k != ENV}
    # Its own session: the terminal's Ctrl-C and a kill of the runner's process group leave it to do its work.
    # Run as a script, in isolated mode: it imports nothing but the standard library. Without it (no interpreter
    # to start: a frozen binary), the plugin's parent-death signal is what is left.
    with contextlib.suppress(OSError):
        _reaper = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(pid)], env=env,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)


def _before_fork() -> None:
    global _forker
    _forker = os.getpid()


def _after_fork_in_child() -> None:
    """In a child forked inside `guard()`: die with the process that forked it, even if it is dead already."""
    if not _tying or _forker is None:
        return
    tie_to_parent()
    if os.getppid() != _forker:
        os._exit(1)


@contextlib.contextmanager
def stopping_on(stop: threading.Event, every: float = 0.5) -> Iterator[None]:
    """Around an engine's start in this process: once `stop` is set, kill the processes the start began (and
    theirs), so that the start fails at once rather than runs its minute to an engine nobody will use."""
    before = _family({os.getpid()})
    done = threading.Event()

    def watch():
        while not done.is_set():
            if stop.wait(every) and not done.is_set():
                # This process's helpers, which the start may have begun, are not the start's.
                from multiprocessing import resource_tracker

                spare = before | {_reaper and _reaper.pid, getattr(resource_tracker._resource_tracker, "_pid", None)}
                for pid in _family({os.getpid()}) - spare:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                done.wait(every)

    thread = threading.Thread(target=watch, name="batchjson-start-stop", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def _family(roots: set[int]) -> set[int]:
    """The descendants of `roots`."""
    parents = _parents()
    found, more = set(), roots
    while more:
        more = {child for child, parent in parents.items() if parent in more} - found
        found |= more
    return found


def _parents() -> dict[int, int]:
    """Every process's parent."""
    parents = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):  # gone meanwhile
                with open(f"/proc/{entry}/stat", "rb") as f:
                    parents[int(entry)] = int(f.read().rsplit(b")", 1)[1].split()[1])
    return parents


def tie_to_parent() -> None:
    """SIGKILL this process when its parent (the thread that started it) dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux
        pass


def wait_for(pid: int) -> None:
    """Return once `pid`, this process's parent, has died."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3), or it is gone already
        fd = None
    while os.getppid() == pid:  # the parent's pid, checked after the pidfd: it is that process
        if fd is None:
            time.sleep(0.2)
        else:
            select.select([fd], [], [], 5.0)


def left_by(pid: int) -> set[int]:
    """The processes of this user whose environment names `pid` as their runner, and their descendants."""
    mark, found = f"{ENV}={pid}".encode(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):  # gone, or another user's
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        found.add(int(entry))
    return found | _family(found)


def reap(pid: int) -> list[int]:
    """Kill what `pid` left; the pids killed."""
    killed = []
    for sweep in range(SWEEPS):
        for left in sorted(left_by(pid)):
            try:
                os.kill(left, signal.SIGKILL)
                killed.append(left)
            except OSError:
                pass
        if sweep + 1 < SWEEPS:
            time.sleep(0.5)
    return killed


def main(pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wait_for(pid)
    killed = reap(pid)
    if killed:
        print(f"batchjson: process {pid} died; killed the {len(killed)} process(es) it left: "
              f"{' '.join(map(str, sorted(set(killed))))}", file=sys.stderr)


if __name__ == "__main__":
    main(int(sys.argv[1]))
