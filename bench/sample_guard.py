"""The sample job under each loop guard: rows stopped in pass 1, valid rows, and vendors right (ground truth).

    python -m bench sample-guard [--out DIR]        (CPU: ~2 min per guard on 2 cores)
Each guard runs the sample job as a user would (`batchjson run`), with only [sampling.repetition_detection]
replaced (none: the schema-chosen default). Prints a table; results to DIR/sample-guard.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq

from bench.common import JOB, P1, ROOT, run_cli

GUARDS = {"default (from the schema)": None, "16, 1, 4": (16, 1, 4), "64, 8, 3": (64, 8, 3)}


def run(label: str, guard, work: Path) -> dict:
    job = work / f"job-{abs(hash(label))}.toml"
    text = JOB.read_text().replace("../", f"{ROOT}/")
    if guard:
        size, least, count = guard
        text = text.replace("[fallback]", f"[sampling.repetition_detection]\nmax_pattern_size = {size}\n"
                            f"min_pattern_size = {least}\nmin_count = {count}\n\n[fallback]", 1)
    job.write_text(text)
    out = work / f"out-{abs(hash(label))}"
    rc, report, tail = run_cli(job, out)
    if report is None:
        raise RuntimeError(f"batchjson run with the guard {label} exited {rc}: {tail}")
    truth = pq.read_table(ROOT / "sample_data" / "sample.parquet").to_pydict()
    vendors = dict(zip(truth["id"], (json.loads(t)["vendor"] for t in truth["truth"])))
    valid = ds.dataset(str(out), format="parquet").to_table(columns=["id", "vendor"]).to_pylist()
    p1 = report["passes"][P1]
    return {"guard": label, "pass1_stopped": p1["reasons"].get("repetition", 0), "pass1_valid": p1["valid"],
            "valid": report["valid"], "vendors_right": sum(r["vendor"] == vendors[r["id"]] for r in valid)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench sample-guard", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/batchjson-bench/sample-guard")
    args = ap.parse_args(argv)
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    rows = [run(label, guard, work) for label, guard in GUARDS.items()]
    (work / "sample-guard.json").write_text(json.dumps(rows, indent=1))
    print("| guard | pass-1 rows stopped | pass-1 valid | valid | vendors right (of 120) |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['guard']} | {r['pass1_stopped']} | {r['pass1_valid']} | {r['valid']} | {r['vendors_right']} |")
    return 0

