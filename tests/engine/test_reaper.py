"""A process that starts engines leaves nothing behind when it is SIGKILLed: what it spawned (and their children)
and what it forked die with it, from their first instant (reaper.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from helpers import gone_within

ROOT = Path(__file__).parents[2]

RUNNER = textwrap.dedent("""
    import multiprocessing, os, subprocess, sys, time
    from batchjson.engine import reaper

    def spawned():
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        time.sleep(120)

    if __name__ == "__main__":
        with reaper.guard():
            child = multiprocessing.get_context("spawn").Process(target=spawned)
            child.start()
            if os.fork() == 0:
                time.sleep(120)
                os._exit(0)
        print("started", flush=True)
        time.sleep(120)
""")


def test_spawned_forked_and_their_children_die_with_a_killed_runner(tmp_path):
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.stdout.readline() == "started\n"
    deadline = time.monotonic() + 30
    while len(psutil.Process(proc.pid).children(recursive=True)) < 5 and time.monotonic() < deadline:
        time.sleep(0.1)  # the reaper, multiprocessing's resource tracker, the spawned child and its own, the forked
    runner = psutil.Process(proc.pid)
    left = [p for p in runner.children(recursive=True) if "reaper.py" not in " ".join(p.cmdline())]
    assert len(left) == 4
    proc.kill()  # the runner alone, as the OOM killer would
    proc.wait()
    assert not gone_within(left, 10), "processes outlived the runner"
