"""`batchjson run` on the fake engine: the product's own command line with its engine factory set to FakeEngines.

    BATCHJSON_BENCH_FAKE=MODEL_DIR python -m bench.fakerun run JOB --output OUT [...]

What the benchmarks start as `batchjson` (common.cli) while the smoke runs: every job's model is replaced by
MODEL_DIR (a tokenizer, no weights: the fake engine reads none) and the engine answers with the sample task's
canned outputs, a share of them failing (overhead.py), so both passes run.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

from batchjson import cli
from batchjson.engine.fake import Answer, FakeEngines
from bench.common import FAKE
from bench.overhead import FAILURES, VALID

PEAK = "BATCHJSON_BENCH_PEAK"  # a file: the process's own peak RSS (KiB) is written there at its exit
FIRST = "BATCHJSON_BENCH_FIRST"  # a file: at the first prompt any engine answers, the time and the runner's reads


def write_peak(path: str) -> None:
    """This process's own peak RSS in KiB (not its children's: Ray's daemons and actors, replicas), for scale_out.py:
    VmHWM, which exec resets. getrusage's ru_maxrss is not reset by exec on Linux: a process forked from a parent of
    2.3 GB (the benchmark after making a 100M-row input) reports 2.3 GB however little it holds itself."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    Path(path).write_text(str(int(status["VmHWM"].split()[0])))


def runner_io() -> dict[str, int]:
    """The runner's /proc/PID/io (rchar: bytes its read calls returned; read_bytes: those from the disk)."""
    pid = os.environ.get("BATCHJSON_RUNNER_PID", str(os.getpid()))  # a replica's runner, else this process
    return {k: int(v) for k, v in (line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())}


class MarkedEngines(FakeEngines):
    """FakeEngines whose first answered prompt, in whichever process, writes FIRST once: the wall time (time.time)
    and the runner's reads so far, so a run's time to first prompt and what its planning read can be measured."""

    def __init__(self, first: str, **kwargs):
        super().__init__(**kwargs)
        self.first = first

    def start(self, spec, decoding, speculative):
        engine = super().start(spec, decoding, speculative)
        answer, first = engine.answer, self.first

        def marked(prompt):
            try:
                fd = os.open(first, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                pass
            else:
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps({"t": time.time(), "runner_io": runner_io()}))
            engine.answer = answer
            return answer(prompt)

        engine.answer = marked
        return engine


def main() -> None:
    if os.environ.get(PEAK):  # registered first, so it runs last: after Ray has shut down
        atexit.register(write_peak, os.environ[PEAK])
    model = os.environ[FAKE]
    marked = {"first": os.environ[FIRST]} if os.environ.get(FIRST) else {}
    engines = (MarkedEngines if marked else FakeEngines)(**marked, valid=0.8, cycle=True, prompt_tokens=300,
                                                         answers=[Answer(v, "stop", 90) for v in VALID],
                                                         failures=list(FAILURES.values()))
    load, run = cli.load_job, cli.run_job  # by name: a renamed product function fails here, not silently

    def load_job(path):
        spec = load(path)
        return dataclasses.replace(spec, model=dataclasses.replace(spec.model, path=model))

    cli.load_job, cli.run_job = load_job, functools.partial(run, engine_factory=engines)
    sys.argv[0] = "batchjson"
    cli.entry()  # the product's way out: Python's teardown once aborted a finished run here (a native thread pool)


if __name__ == "__main__":
    main()
