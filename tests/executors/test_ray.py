"""Replicas as Ray actors on a local Ray cluster: one is killed mid-run (CPU, the tiny model, the real engine), its
open units are redone by another, and every input id ends up exactly once; a job of several files with generated
ids on the fake engine ends with every row once and nothing reported dead; a local Ray start that timed out is
tried once more."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchjson.cli import main
from helpers import ENV, HERE, assert_exactly_once, codes, write_job, write_rows

pytest.importorskip("ray", reason="Ray mode needs the ray extra: pip install 'batchjson[ray]'")


def committed(out: Path) -> int:
    return len(list((out / "_batchjson" / "units").glob("p1-*.json")))


def actors(runner: int) -> list[psutil.Process]:
    """The replica actors of this runner's Ray instance (a local one is the runner's own: its raylet and workers are
    the runner's descendants), not those of another run on the machine."""
    found = []
    for process in psutil.Process(runner).children(recursive=True):
        with contextlib.suppress(psutil.Error):  # gone, or a zombie, since listed
            if "RayReplica" in " ".join(process.cmdline()):
                found.append(process)
    return found


@pytest.mark.engine
@pytest.mark.closes_shared_engines
def test_ray_replica_killed_mid_run(tmp_path, tiny_model, engines):
    # Earlier tests of the session leave engines open (each an engine core and a worker process, about 2.5 GB) and
    # variables of theirs in os.environ. The engines go first, and the runner gets the session's environment as it
    # began. A Ray start is slow on a small machine: when Ray's dashboard agent has not written its port file by the
    # time the raylet stops waiting, the raylet aborts and the runner exits at start.
    engines.close()
    # 16 units: the other replica finishes what is left, the killed one's units included, within seconds, mostly
    # before the replica started in its place asks for work (that one would start an engine of its own).
    write_rows(tmp_path / "in.parquet", 64)
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
        running = actors(runner.pid)
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
    assert_exactly_once([f"r{i:05d}" for i in range(64)], out, out / "_rejects")


def test_a_job_of_several_files_with_generated_ids_on_ray_actors(tmp_path, tiny_model):
    """The scale-out path on the fake engine: three input files without an id column, two replicas as Ray actors
    on a local Ray instance the run starts. Every row ends up once under the id its place gives it, the run's own
    check and `batchjson verify` pass, and no replica is reported dead (one that finished is not one that died)."""
    (tmp_path / "in").mkdir()
    for k in range(3):
        pq.write_table(pa.table({"text": [f"thing {k}-{i}" for i in range(40)], "source": ["s"] * 40}),
                       tmp_path / "in" / f"part-{k}.parquet", row_group_size=16)
    job = write_job(tmp_path, tiny_model, tmp_path / "in", batch_size=8)
    job.write_text(job.read_text().replace("[input]\n", "[input]\ngenerate_ids = true\n", 1))
    env = ENV | {"RAY_ADDRESS": "", "FAKE_RAY": "auto", "FAKE_DELAY": "0.01"}
    runner = subprocess.run([sys.executable, str(HERE / "fake_runner.py"), str(job), str(tmp_path / "out"), "begin",
                             "0", "", "2"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert runner.returncode == 0, runner.stderr[-4000:]
    report = json.loads((tmp_path / "out" / "_report.json").read_text())
    assert report["replicas"] == 2
    assert report["verified"]["ok"] and report["verified"]["complete"], report["verified"]
    assert not [c for p in report["passes"].values() for c in codes(p) if c == "replica-died"], report["passes"]
    expected = [f"part-{k}.parquet:{i // 16}:{i % 16}" for k in range(3) for i in range(40)]
    assert_exactly_once(expected, tmp_path / "out", tmp_path / "out" / "_rejects")
    result = CliRunner().invoke(main, ["verify", str(job)])
    assert result.exit_code == 0 and "exactly-once check ok" in result.output, result.output


class _Ray:
    """ray.init failing `fails` times with Ray's own bare Exception, as a local start that timed out does."""

    def __init__(self, fails: int):
        self.fails, self.inits, self.shutdowns = fails, 0, 0

    def init(self, **kwargs):
        self.inits += 1
        if self.inits <= self.fails:
            raise Exception("The current node timed out during startup.")

    def shutdown(self):
        self.shutdowns += 1


def test_a_local_ray_start_that_timed_out_is_tried_once_more_then_named(monkeypatch):
    from batchjson.errors import EngineError
    from batchjson.executors.ray import _connect

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    once = _Ray(fails=1)
    _connect(once, "auto")
    assert (once.inits, once.shutdowns) == (2, 1)
    with pytest.raises(EngineError, match="Ray could not start a local instance .*timed out.*RAY_ADDRESS"):
        _connect(_Ray(fails=2), "auto")
