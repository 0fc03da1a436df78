"""One job on a local Ray cluster of N CPU workers on the fake engine: what the driver holds as the rows grow, and
`batchjson verify`'s own peak on the finished job (BENCHMARKS.md, "A job on a Ray cluster, and verify, by rows").

    python -m bench scale-out --rows 1000000,10000000 [--files 4] [--workers 2] [--ids generated|column]
                              [--verify] [--work DIR] [--out DIR]

Per row count: the input (FILES Parquet files, one text column, and ids `row-000000000`... or none: generated
ids), made once under WORK; then `batchjson run JOB --ray --replicas N` (bench/fakerun.py: the fake engine, a
tokenizer for a model) in a fresh output folder, the driver starting its own local Ray instance with N CPUs
(RAY_OVERRIDE_RESOURCES), one actor per replica; `--workers 0` runs the one engine in the driver's process instead.
The driver's peak RSS is its own (getrusage RUSAGE_SELF at its exit): Ray's daemons and actors are other processes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import FAKE, ROOT, WORK, table
from bench.fakerun import PEAK


def make_input(w: Path, rows: int, files: int, ids: str) -> Path:
    """FILES Parquet files of `rows` rows in all, a tokenizer-only model and the job's spec; made once per folder."""
    job = w / "job.toml"
    if job.exists():
        return job
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from bench.smoke import tokenizer_model

    w.mkdir(parents=True, exist_ok=True)
    tokenizer_model(w / "model")
    for k in range(files):
        n = pa.array(range(k * rows // files, (k + 1) * rows // files)).cast(pa.string())
        columns = {"text": pc.binary_join_element_wise("invoice ", n, "")}
        if ids == "column":
            columns = {"id": pc.binary_join_element_wise("row-", pc.utf8_lpad(n, 9, "0"), "")} | columns
        pq.write_table(pa.table(columns), w / f"in-{k}.parquet")
    id_line = 'id_column = "id"' if ids == "column" else "generate_ids = true"
    job.write_text(f'[input]\npath = "{w}/in-*.parquet"\n{id_line}\n[prompt]\ntemplate = "Extract: {{text}}"\n'
                   f'[schema]\npath = "{ROOT}/sample_data/schema.json"\n[model]\npath = "{w}/model"\n'
                   f'[output]\npath = "{w}/out"\n')
    return job


def measured(args: list[str], env: dict, w: Path) -> dict:
    """Run `batchjson ARGS` on the fake engine (bench/fakerun.py): exit code, seconds, the process's own peak RSS in
    MiB, which it writes at its exit (Ray's daemons and actors, reaped through it, would count in its children's)."""
    peak = w / "peak"
    peak.unlink(missing_ok=True)
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "bench.fakerun", *args], env=env | {PEAK: str(peak)}, cwd=w,
                       capture_output=True, text=True)
    out = {"rc": p.returncode, "s": round(time.monotonic() - t, 1),
           "peak_mib": round(int(peak.read_text()) / 1024) if peak.exists() else None}
    if p.returncode:
        print(p.stdout[-2000:] + p.stderr[-4000:], file=sys.stderr)
    return out


def verified(job: Path, env: dict) -> dict:
    """`batchjson verify JOB` as a user runs it (no engine, no child process): exit code, seconds, peak RSS in MiB."""
    t = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "batchjson", "verify", str(job)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    output = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        print(output[-4000:], file=sys.stderr)
    return {"rc": p.returncode, "s": round(time.monotonic() - t, 1), "peak_mib": round(usage.ru_maxrss / 1024)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench scale-out", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1000000,10000000", help="row counts, comma-separated")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2, help="Ray actors, one engine each (0: no Ray, one engine in "
                    "the driver's process)")
    ap.add_argument("--ids", choices=("generated", "column"), default="generated")
    ap.add_argument("--verify", action="store_true", help="then `batchjson verify` on the finished job")
    ap.add_argument("--work", type=Path, default=WORK / "scale-out")
    ap.add_argument("--out", type=Path, help="write the results here (scale-out.json)")
    args = ap.parse_args(argv)
    results = []
    for rows in map(int, args.rows.split(",")):
        w = args.work / f"{rows}-{args.files}f-{args.ids}"
        job = make_input(w, rows, args.files, args.ids)
        shutil.rmtree(w / "out", ignore_errors=True)
        env = os.environ | {FAKE: str(w / "model"), "RAY_ADDRESS": "",
                            "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": max(args.workers, 1)})}
        ray = ["--ray", "--replicas", str(args.workers)] if args.workers else []
        run = measured(["run", str(job), *ray], env, w)
        report = json.loads((w / "out" / "_report.json").read_text()) if (w / "out" / "_report.json").exists() else {}
        row = {"rows": rows, "files": args.files, "ids": args.ids, "workers": args.workers,
               "units": report.get("verified", {}).get("units"), "run_rc": run["rc"], "run_s": run["s"],
               "driver_peak_mib": run["peak_mib"], "verified": report.get("verified", {}).get("ok")}
        if args.verify:
            check = verified(job, env)
            row |= {"verify_rc": check["rc"], "verify_s": check["s"], "verify_peak_mib": check["peak_mib"]}
        results.append(row)
        print(json.dumps(row), flush=True)
    columns = [("rows", "rows"), ("units", "units"), ("workers", "Ray workers"), ("run_s", "run s"),
               ("driver_peak_mib", "driver peak MiB"), ("verified", "exactly once")]
    if args.verify:
        columns += [("verify_s", "verify s"), ("verify_peak_mib", "verify peak MiB")]
    print(table(results, columns))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "scale-out.json").write_text(json.dumps(results, indent=1))
    bad = [r for r in results if r["run_rc"] or not r["verified"] or r.get("verify_rc")]
    return 1 if bad else 0
