"""Runs a job with the fake engine and SIGKILLs itself at the N-th time the commit protocol reaches STEP.

    python tests/fake_runner.py JOB OUTPUT STEP N [SHARD [REPLICAS]]     (N = 0 never kills)
STEP "p2:<step>" counts that step in pass 2 only.
FAKE_LEASE_EXPIRY (seconds) shortens the leases on object storage; FAKE_VALID sets the share of valid answers (0.6);
FAKE_RAY runs the replicas as Ray actors (--ray: "auto", or a cluster's address); FAKE_FOLD_MIN folds the records
into a part of the index every that many (start.FOLD_MIN).
Steps: begin, staged output|rejects|requeue, committed, published output|rejects|requeue (see storage/commits.py).
"""

import os
import signal
import sys

from batchjson import start as start_module, storage
from batchjson.engine.fake import FakeEngines
from batchjson.job import run_job
from batchjson.spec import load_spec, parse_shard
from helpers import at_commit_step


def main():
    job, output, step, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    shard = parse_shard(sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] else None)
    replicas = int(sys.argv[6]) if len(sys.argv) > 6 else None
    at_commit_step(step, n, lambda: os.kill(os.getpid(), signal.SIGKILL))
    if os.environ.get("FAKE_FOLD_MIN"):
        start_module.FOLD_MIN = int(os.environ["FAKE_FOLD_MIN"])
    if os.environ.get("FAKE_LEASE_EXPIRY"):  # object storage: a killed run blocks the next one this long
        storage.Lease.EXPIRY = float(os.environ["FAKE_LEASE_EXPIRY"])
        storage.Lease.RENEW_EVERY = storage.Lease.EXPIRY / 4
    engines = FakeEngines(start_delay=float(os.environ.get("FAKE_START_DELAY", "0")),
                          delay=float(os.environ.get("FAKE_DELAY", "0")),
                          start_marker=os.environ.get("FAKE_START_MARKER"),
                          valid=float(os.environ.get("FAKE_VALID", "0.6")))
    report = run_job(load_spec(job), output, shard=shard, engine_factory=engines, progress=False,
                     replicas=replicas, ray=os.environ.get("FAKE_RAY") or None)
    print(report.summary())
    sys.exit(130 if report.interrupted else 3 if report.verify_failed else 0)


if __name__ == "__main__":
    main()
