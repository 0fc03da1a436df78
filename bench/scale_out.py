"""One job on a local Ray cluster of N CPU workers on the fake engine: what the driver holds as the rows grow, and
`batchjson verify`'s own peak on the finished job (BENCHMARKS.md, "A job on a Ray cluster, and verify, by rows").

    python -m bench scale-out --rows 1000000,10000000 [--files 4] [--workers 2] [--local] [--ids generated|column]
                              [--schema sample|object] [--crash-at SHARE] [--verify] [--work DIR] [--out DIR]

Per row count: the input (FILES Parquet files, one text column, and ids `row-000000000`... or none: generated
ids), made once under WORK; then `batchjson run JOB --ray --replicas N` (bench/fakerun.py: the fake engine, a
tokenizer for a model) in a fresh output folder, the driver starting its own local Ray instance with N CPUs
(RAY_OVERRIDE_RESOURCES), one actor per replica; `--local`: `batchjson run JOB --replicas N`, the replicas local
processes, no Ray; `--workers 0` runs the one engine in the driver's process instead.
The driver's peak RSS is its own (getrusage RUSAGE_SELF at its exit): Ray's daemons and actors, and local replicas,
are other processes. Each run's time to its first prompt (from its start to the first prompt an engine answers) and
what the driver had read by then (/proc/PID/io: rchar, every read call's bytes, page cache or not) are kept too.
`--crash-at 0.99`: the run is killed (SIGKILL, the driver; its replicas die with it) once 99% of the rows are
done by its progress file (its peak so far: VmHWM), then run again: the resume's time to first prompt, reads and
peak against the first run's. A run whose last share passes between two writes of its progress file ends unkilled
(killed_at_rows null; seen at 1M rows, where the last 1% takes under a second).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.common import FAKE, ROOT, WORK, table
from bench.fakerun import FIRST, PEAK


def make_input(w: Path, rows: int, files: int, ids: str, schema: str = "sample") -> Path:
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
                   + ("[schema]\njson_object = true\n" if schema == "object" else
                      f'[schema]\npath = "{ROOT}/sample_data/schema.json"\n') + f'[model]\npath = "{w}/model"\n'
                   f'[output]\npath = "{w}/out"\n')
    return job


def done_rows(w: Path) -> int:
    """Rows done by the run's progress file: pass 1's output, pass 2's output and rejects."""
    try:
        passes = json.loads((w / "out" / "_batchjson" / "progress-0of1.json").read_text())["passes"]
        return passes["p1"]["output"] + passes["p2"]["output"] + passes["p2"]["rejects"]
    except (OSError, ValueError, KeyError):
        return 0


def measured(args: list[str], env: dict, w: Path, kill_at: int | None = None) -> dict:
    """Run `batchjson ARGS` on the fake engine (bench/fakerun.py): exit code, seconds, the process's own peak RSS in
    MiB, which it writes at its exit (Ray's daemons and actors, reaped through it, would count in its children's),
    its time to the first prompt and what it had read by then. `kill_at`: SIGKILL it once that many rows are done,
    its peak so far taken from /proc (VmHWM)."""
    peak, first, log = w / "peak", w / "first", w / "run.log"
    peak.unlink(missing_ok=True)
    first.unlink(missing_ok=True)
    t = time.time()
    with log.open("w") as f:
        p = subprocess.Popen([sys.executable, "-m", "bench.fakerun", *args], env=env | {PEAK: str(peak),
                             FIRST: str(first)}, cwd=w, stdout=f, stderr=subprocess.STDOUT)
    out = {}
    while kill_at is not None and p.poll() is None:
        done = done_rows(w)
        if done >= kill_at:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{p.pid}/status").read_text().splitlines())
            os.kill(p.pid, signal.SIGKILL)
            out |= {"killed_at_rows": done, "peak_mib": round(int(status["VmHWM"].split()[0]) / 1024)}
            break
        time.sleep(0.5)
    p.wait()
    out |= {"rc": p.returncode, "s": round(time.time() - t, 1)}
    if peak.exists():
        out["peak_mib"] = round(int(peak.read_text()) / 1024)
    if first.exists():
        mark = json.loads(first.read_text())
        out |= {"first_prompt_s": round(mark["t"] - t, 1), "read_mb": round(mark["runner_io"]["rchar"] / 1e6, 1)}
    if p.returncode and kill_at is None:
        print(log.read_text()[-6000:], file=sys.stderr)
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
    ap.add_argument("--local", action="store_true", help="the replicas as local processes, not Ray actors")
    ap.add_argument("--ids", choices=("generated", "column"), default="generated")
    ap.add_argument("--schema", choices=("sample", "object"), default="sample",
                    help="the sample schema, or any JSON object (json_object: the cheapest validation)")
    ap.add_argument("--crash-at", type=float, help="kill the run (SIGKILL) at this share of its rows done, then "
                    "resume it")
    ap.add_argument("--verify", action="store_true", help="then `batchjson verify` on the finished job")
    ap.add_argument("--work", type=Path, default=WORK / "scale-out")
    ap.add_argument("--out", type=Path, help="write the results here (scale-out.json)")
    args = ap.parse_args(argv)
    results = []
    for rows in map(int, args.rows.split(",")):
        w = args.work / f"{rows}-{args.files}f-{args.ids}" / ("" if args.schema == "sample" else args.schema)
        # made in a process of its own: a run forked from a parent that held the input would count the parent's
        # pages in its peak (`verified`'s wait4 reports the child's ru_maxrss, which the fork's memory is in)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as maker:
            job = maker.submit(make_input, w, rows, args.files, args.ids, args.schema).result()
        shutil.rmtree(w / "out", ignore_errors=True)
        env = os.environ | {FAKE: str(w / "model"), "RAY_ADDRESS": "",
                            "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": max(args.workers, 1)})}
        replicas = ["--replicas", str(args.workers)] if args.workers else []
        ray = replicas if args.local else ["--ray", *replicas] if args.workers else []
        run = measured(["run", str(job), *ray], env, w, None if args.crash_at is None else int(args.crash_at * rows))
        if args.crash_at is not None:
            resume = measured(["run", str(job), *ray], env, w)
        report = json.loads((w / "out" / "_report.json").read_text()) if (w / "out" / "_report.json").exists() else {}
        row = {"rows": rows, "files": args.files, "ids": args.ids, "schema": args.schema, "workers": args.workers,
               "replicas": "local" if args.local else "ray" if args.workers else "inline",
               "units": report.get("verified", {}).get("units"), "run_rc": run["rc"], "run_s": run["s"],
               "driver_peak_mib": run.get("peak_mib"), "first_prompt_s": run.get("first_prompt_s"),
               "read_mb_to_first_prompt": run.get("read_mb"), "verified": report.get("verified", {}).get("ok")}
        if args.crash_at is not None:
            row |= {"killed_at_rows": run.get("killed_at_rows"), "resume_rc": resume["rc"], "resume_s": resume["s"],
                    "resume_peak_mib": resume.get("peak_mib"), "resume_first_prompt_s": resume.get("first_prompt_s"),
                    "resume_read_mb_to_first_prompt": resume.get("read_mb"), "resume_timeline": report.get("timeline")}
        if args.verify:
            check = verified(job, env)
            row |= {"verify_rc": check["rc"], "verify_s": check["s"], "verify_peak_mib": check["peak_mib"]}
        results.append(row)
        print(json.dumps(row), flush=True)
    columns = [("rows", "rows"), ("units", "units"), ("workers", "replicas"), ("replicas", "as"), ("run_s", "run s"),
               ("driver_peak_mib", "driver peak MiB"), ("first_prompt_s", "first prompt s"),
               ("read_mb_to_first_prompt", "read MB by then"), ("verified", "exactly once")]
    if args.crash_at is not None:
        columns += [("resume_s", "resume s"), ("resume_peak_mib", "resume peak MiB"),
                    ("resume_first_prompt_s", "resume first prompt s"), ("resume_read_mb_to_first_prompt", "read MB")]
    if args.verify:
        columns += [("verify_s", "verify s"), ("verify_peak_mib", "verify peak MiB")]
    print(table(results, columns))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "scale-out.json").write_text(json.dumps(results, indent=1))
    bad = [r for r in results if (r["run_rc"] if args.crash_at is None else r["resume_rc"]) or not r["verified"]
           or r.get("verify_rc")]
    return 1 if bad else 0
