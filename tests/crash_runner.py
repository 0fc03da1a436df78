"""Runs a job on the real engine and SIGKILLs its own process alone after N results of one pass, as the OOM killer
would, having printed the ids of the processes it started ("started: PID ...", its engine processes among them),
which must die with it.

    python tests/crash_runner.py JOB OUTPUT PASS N      (PASS 1 or 2; N = 0 never kills)
"""

import os
import signal
import sys

import psutil

from batchjson.engine import EngineWrapper, VllmEngines, WrappedEngines
from batchjson.job import run_job
from batchjson.spec import load_spec


class KillAfter(EngineWrapper):
    """The real engine; this process is killed once `n` results of pass `kill_pass` have been handed to the
    runner, over every engine of the run (both passes share an engine: results of the other pass do not count)."""

    seen = 0

    def __init__(self, inner, kill_pass, n):
        super().__init__(inner)
        self.kill_pass, self.n = kill_pass, n

    def stream(self, prompts, stop=None):
        for gen in self.inner.stream(prompts, stop):
            yield gen
            if gen.prompt.stage.number == self.kill_pass:
                KillAfter.seen += 1
                if KillAfter.seen == self.n:
                    print("started:", *(p.pid for p in psutil.Process().children(recursive=True)), flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)


def main():
    job, output, kill_pass, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    spec = load_spec(job)
    factory = WrappedEngines(VllmEngines(), lambda engine: KillAfter(engine, kill_pass, n) if n else engine)
    report = run_job(spec, output, engine_factory=factory, progress=False)
    print(report.summary())


if __name__ == "__main__":
    main()
