"""The sample job under each loop guard: rows stopped in pass 1, valid rows, and vendors right (ground truth).

    python bench/sample_guard.py [--out DIR]        (CPU: ~2 min per guard on 2 cores)
Each guard runs the sample job as a user would (`batchjson run`), with only [sampling.repetition_detection]
replaced (none: the schema-chosen default). Prints a table; results to DIR/sample-guard.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
GUARDS = {"default (from the schema)": None, "16, 1, 4": (16, 1, 4), "64, 8, 3": (64, 8, 3)}


def run(label: str, guard, work: Path) -> dict:
    job = work / f"job-{abs(hash(label))}.toml"
    text = (ROOT / "jobs" / "sample.toml").read_text().replace("../", f"{ROOT}/")
    if guard:
        size, least, count = guard
        text = text.replace("[fallback]", f"[sampling.repetition_detection]\nmax_pattern_size = {size}\n"
                            f"min_pattern_size = {least}\nmin_count = {count}\n\n[fallback]", 1)
    job.write_text(text)
    out = work / f"out-{abs(hash(label))}"
    subprocess.run([sys.executable, "-m", "batchjson", "run", str(job), "--output", str(out), "--fresh"],
                   check=True, capture_output=True, text=True)
    report = json.loads((out / "_report.json").read_text())
    truth = pq.read_table(ROOT / "sample_data" / "sample.parquet").to_pydict()
    vendors = dict(zip(truth["id"], (json.loads(t)["vendor"] for t in truth["truth"])))
    valid = ds.dataset(str(out), format="parquet").to_table(columns=["id", "vendor"]).to_pylist()
    p1 = report["passes"]["pass1"]
    return {"guard": label, "pass1_stopped": p1["reasons"].get("repetition", 0), "pass1_valid": p1["valid"],
            "valid": report["valid"], "vendors_right": sum(r["vendor"] == vendors[r["id"]] for r in valid)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/batchjson-bench/sample-guard")
    args = ap.parse_args()
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    rows = [run(label, guard, work) for label, guard in GUARDS.items()]
    (work / "sample-guard.json").write_text(json.dumps(rows, indent=1))
    print("| guard | pass-1 rows stopped | pass-1 valid | valid | vendors right (of 120) |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['guard']} | {r['pass1_stopped']} | {r['pass1_valid']} | {r['valid']} | {r['vendors_right']} |")


if __name__ == "__main__":
    main()
