"""Runs a job on the real engine and SIGKILLs its own process group after N results of one pass.

    python tests/crash_runner.py JOB OUTPUT PASS N      (PASS 1 or 2; N = 0 never kills)
Started in a new session by the tests, so the kill takes the engine processes down too, as a pre-emption would.
"""

import os
import signal
import sys

from batchjson.engine import EngineWrapper
from batchjson.job import run_job, vllm_engine
from batchjson.spec import load_spec


class KillAfter(EngineWrapper):
    """The real engine; the process group is killed once `n` results have been handed to the runner."""

    def __init__(self, inner, n):
        super().__init__(inner)
        self.n = n

    def stream(self, prompts, stop=None):
        for i, gen in enumerate(self.inner.stream(prompts, stop), 1):
            yield gen
            if i == self.n:
                os.killpg(os.getpgid(0), signal.SIGKILL)


def main():
    job, output, kill_pass, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    spec = load_spec(job)

    def factory(spec_, decoding, speculative):
        engine = vllm_engine(spec_, decoding, speculative)
        this_pass = 2 if decoding is spec_.fallback else 1
        return KillAfter(engine, n) if n and this_pass == kill_pass else engine

    report = run_job(spec, output, engine_factory=factory, progress=False)
    print(report.summary())


if __name__ == "__main__":
    main()
