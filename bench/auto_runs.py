"""`speculative.method = "auto"` in its own runs: one `batchjson run` per task and in-flight size, on the rows
`python -m bench spec-profile` decodes at that size, with what auto chose, why, and the output tokens/s of its decoding.

    python -m bench auto-runs --tasks B --in-flight 1,8,32,128,512 --model /tmp/models/smollm2 --out OUT

Each run is a new user's job for the task (bench/tasks.py: bounded schema, max_tokens 256 as in the profile) with
`[model] max_in_flight` set to the size and `[speculative] method` (default auto), run by the CLI in its own process
on a fresh folder. Prints a table and writes OUT/auto-<tasks>.json. Compare its tok/s with spec_profile's fixed
methods at the same size: auto's is measured through the whole runner (validation and commits included) on a fresh
engine, so it is, if anything, the lower of the two.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.common import P1, P2, run_cli
from bench.tasks import write_task


def one(task: str, size: int, rows: int, args) -> dict:
    folder = Path(args.work) / f"{task}-{size}"
    _, job = write_task(task, rows, folder, args.model, max_tokens=args.max_tokens, bounded=True,
                        extra=f'\n[speculative]\nmethod = "{args.method}"\n')
    text = job.read_text()
    job.write_text(text.replace("[model]\n", f"[model]\nmax_in_flight = {size}\n", 1))
    started = time.time()
    rc, report, tail = run_cli(job, folder / "out", timeout=args.timeout)
    wall = round(time.time() - started, 1)
    result = {"task": task, "in_flight": size, "rows": rows, "method": args.method, "rc": rc, "wall_s": wall}
    if report is None:
        return result | {"error": tail}
    p1 = report["passes"][P1]
    auto = (p1.get("auto") or [{}])[0]
    trials = auto.get("trials", [])
    result |= {"chosen": auto.get("chosen", args.method), "why": auto.get("why", ""), "trials": trials,
               "decode_tokens_per_s": trials[-1]["output_tokens_per_s"] if trials else None,
               "pass1_output_tokens_per_s": p1["output_tokens_per_s"], "pass1_s": p1["seconds"],
               "valid": sum(report["valid_by_pass"].values()), "run_s": report["seconds"],
               "pass2_note": report["passes"].get(P2, {}).get("note", "")}
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench auto-runs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="B")
    ap.add_argument("--in-flight", default="1,8,32,128,512")
    ap.add_argument("--waves", type=int, default=2, help="rows per size = waves x in flight (at least --min-rows)")
    ap.add_argument("--min-rows", type=int, default=16)
    ap.add_argument("--model", default="/tmp/models/smollm2")
    ap.add_argument("--method", default="auto")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--timeout", type=int, default=150, help="seconds per run")
    ap.add_argument("--out", default="auto-results")
    ap.add_argument("--work", default="/tmp/auto-runs")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for task in args.tasks.split(","):
        for size in (int(x) for x in args.in_flight.split(",")):
            results.append(one(task, size, max(args.min_rows, args.waves * size), args))
            r = results[-1]
            print(f"[auto] {task} {size}: rc {r['rc']}, {r.get('chosen')} at {r.get('decode_tokens_per_s')} tok/s, "
                  f"run {r.get('run_s')} s; {r.get('why', r.get('error', ''))[:200]}", flush=True)
            (out / f"auto-{args.tasks.replace(',', '')}.json").write_text(json.dumps(results, indent=1))
    print("\n| task | in flight | rows | chosen | decode tok/s | pass 1 s | whole run s | valid |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['task']} | {r['in_flight']} | {r['rows']} | {r.get('chosen', 'error')} | "
              f"{r.get('decode_tokens_per_s')} | {r.get('pass1_s')} | {r.get('run_s')} | {r.get('valid')} |")
    return 1 if any("error" in r for r in results) else 0

