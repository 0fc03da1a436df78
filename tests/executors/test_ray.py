"""Replicas as Ray actors on a local Ray cluster (CPU, the tiny model, the real engine): one is killed mid-run,
its open units are redone by another, and every input id ends up exactly once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers import ENV, assert_exactly_once, codes, write_job, write_rows

pytest.importorskip("ray", reason="Ray mode needs the ray extra: pip install 'batchjson[ray]'")


def committed(out: Path) -> int:
    return len(list((out / "_batchjson" / "units").glob("p1-*.json")))


def actors() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if "RayReplica" in " ".join(p.info["cmdline"] or ())]


@pytest.mark.engine
def test_ray_replica_killed_mid_run(tmp_path, tiny_model, engines):
    # Earlier tests of the session leave engines open (each an engine core and a worker process, about 2.5 GB) and
    # variables of theirs in os.environ. The engines go first, and the runner gets the session's environment as it
    # began. A Ray start is slow on a small machine: when Ray's dashboard agent has not written its port file by the
    # time the raylet stops waiting, the raylet aborts and the runner exits at start.
    engines.close()
    write_rows(tmp_path / "in.parquet", 160)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", batch_size=4, speculative="none",
                    extra="")
    out = tmp_path / "out"
    env = ENV | {"RAY_ADDRESS": "", "VLLM_CPU_KVCACHE_SPACE": "1"}
    runner = subprocess.Popen([sys.executable, "-m", "batchjson", "run", str(job), "--ray", "--replicas", "2"], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        deadline = time.monotonic() + 400
        while committed(out) < 4 and time.monotonic() < deadline and runner.poll() is None:
            time.sleep(0.2)
        if runner.poll() is not None:
            pytest.fail(f"the runner exited with {runner.returncode} before killing a replica:\n"
                        f"{runner.communicate()[1][-4000:]}")
        running = actors()
        assert len(running) == 2, running
        running[0].send_signal(signal.SIGKILL)
        stdout, stderr = runner.communicate(timeout=600)
    finally:
        runner.kill()
    assert runner.returncode == 0, stderr[-4000:]
    report = json.loads((out / "_report.json").read_text())  # stdout carries vLLM's log lines too
    assert report["replicas"] == 2
    assert report["verified"]["ok"] and report["verified"]["complete"], report["verified"]
    assert "replica-died" in codes(report["passes"]["pass1"]), report["passes"]["pass1"]
    assert_exactly_once([f"r{i:05d}" for i in range(160)], out, out / "_rejects")
