"""The embedded default, as a newcomer runs it: `batchjson run jobs/sample.toml` on SmolLM2-135M-Instruct, on the
first 24 of its 120 rows (`--input`): the whole job's 1.5-4 minutes on a CPU went mostly to decoding the rest, which
tells nothing more (`make run` runs it whole; BENCHMARKS.md, "The sample job on a CPU")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from helpers import codes

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.engine


ROWS = 24


def test_sample_job_end_to_end(tmp_path):
    out, rows = tmp_path / "out", tmp_path / "sample.parquet"
    pq.write_table(pq.read_table(ROOT / "sample_data" / "sample.parquet").slice(0, ROWS), rows)
    cmd = [sys.executable, "-m", "batchjson", "run", str(ROOT / "jobs" / "sample.toml"), "--input", str(rows),
           "--output", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{ROWS} input rows" in result.stdout

    truth = pq.read_table(rows).to_pydict()
    valid = ds.dataset(str(out), format="parquet").to_table().to_pylist()
    rejects = list((out / "_rejects").glob("*.parquet"))
    rejected = ds.dataset([str(p) for p in rejects], format="parquet").to_table().to_pylist() if rejects else []
    ids = [r["id"] for r in valid] + [r["id"] for r in rejected]
    assert sorted(ids) == sorted(truth["id"])  # every row in exactly one place

    report = json.loads((out / "_report.json").read_text())
    assert report["input_rows"] == ROWS and report["valid"] == len(valid) and report["rejected"] == len(rejected)
    # speculative.method = "auto": on a CPU speculation gains nothing, so pass 1 decodes without it and says why,
    # and the fallback runs on pass 1's engine.
    (choice,) = report["passes"]["pass1"]["auto"]
    assert choice["chosen"] == "none" and choice["why"] and choice["trials"][0]["output_tokens_per_s"] > 0
    assert "shared-engine" in codes(report["passes"]["pass2"])
    # Which fill path made the grammar's masks, and what a step of the pass cost.
    assert "masks: batch" in report["passes"]["pass1"]["grammar"] and report["ms_per_step"] > 0
    assert f"; {report['engine_steps']:,} steps, {report['ms_per_step']:.1f} ms a step" in result.stdout
    # SmolLM2 loops inside the items array under greedy decoding; repetition detection stops those rows early
    # and the sampled fallback rescues most of them.
    assert report["passes"]["pass1"]["reasons"].get("repetition", 0) > 0
    assert report["rescued_by_fallback"] >= report["passes"]["pass2"]["rows"] // 2
    vendors = dict(zip(truth["id"], (json.loads(t)["vendor"] for t in truth["truth"])))
    right = sum(r["vendor"] == vendors[r["id"]] for r in valid)
    assert right >= len(valid) // 2, f"only {right} of {len(valid)} vendors match the ground truth"
