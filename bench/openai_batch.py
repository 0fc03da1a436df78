"""OpenAI Batch files in and out at scale: peak memory and time of `batchjson import-openai` and `export-openai` per
requests file size, with the run between them on the fake engine (BENCHMARKS.md, "OpenAI Batch files").

    python -m bench openai-batch [--lines 10000,100000] [--work DIR] [--out FILE]

Each size writes a requests file of the sample task (its invoice texts in turn, its schema as the response_format),
imports it, runs the job (`batchjson run` on the fake engine: bench/fakerun.py, with a tokenizer-only model),
exports it, and checks that the output holds each request once, in order. Import and export run as processes of
their own, each measured alone (its peak RSS from wait4).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import FAKE, MB, ROOT, dump, table

SAMPLE = ROOT / "sample_data"


def write_requests(path: Path, lines: int) -> int:
    """`lines` chat-completion requests of the sample task; returns the file's size in bytes."""
    import pyarrow.parquet as pq

    texts = pq.read_table(SAMPLE / "sample.parquet", columns=["text"]).column("text").to_pylist()
    schema = json.loads((SAMPLE / "schema.json").read_text())
    fmt = {"type": "json_schema", "json_schema": {"name": "invoice", "strict": True, "schema": schema}}
    with path.open("w") as f:
        for i in range(lines):
            body = {"model": "gpt-4o-mini", "max_tokens": 320, "temperature": 0, "response_format": fmt,
                    "messages": [{"role": "system", "content": "You extract invoice data and answer with JSON."},
                                 {"role": "user", "content": texts[i % len(texts)]}]}
            f.write(json.dumps({"custom_id": f"invoice-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")
    return path.stat().st_size


def measured(cmd: list[str], env: dict, ok: tuple[int, ...] = (0,)) -> tuple[float, float]:
    """Run `cmd` to its end: (seconds, its peak RSS in MiB), or exit with its output (on an exit code not in
    `ok`)."""
    t = time.monotonic()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode not in ok:
        sys.exit(f"{' '.join(cmd)} exited {p.returncode}:\n{out.decode()[-3000:]}")
    return time.monotonic() - t, usage.ru_maxrss * 1024 / MB


def one(lines: int, work: Path, env: dict) -> dict:
    folder = work / f"lines-{lines}"
    requests = folder / "requests.jsonl"
    folder.mkdir(parents=True, exist_ok=True)
    size = write_requests(requests, lines)
    jobs = folder / "jobs"
    batchjson = [sys.executable, "-m", "batchjson"]
    import_s, import_mb = measured([*batchjson, "import-openai", str(requests), str(jobs)], env)
    # exit 3: the fake engine's failures exceed output.max_reject_rate (5%), which the export does not mind
    run_s, _ = measured([sys.executable, "-m", "bench.fakerun", "run", str(jobs / "invoice" / "job.toml")], env,
                        ok=(0, 3))
    out, errors = folder / "results.jsonl", folder / "errors.jsonl"
    export_s, export_mb = measured([*batchjson, "export-openai", str(jobs), str(out), "--errors", str(errors)], env)
    ids = [json.loads(line)["custom_id"] for path in (out, errors) for line in path.open()]
    if sorted(ids, key=lambda i: int(i.split("-")[1])) != [f"invoice-{i}" for i in range(lines)]:
        sys.exit(f"{lines} lines: the output does not hold each request once")
    return {"lines": lines, "file_mb": size / MB, "import_s": import_s, "import_mb": import_mb, "run_s": run_s,
            "export_s": export_s, "export_mb": export_mb, "answers": sum(1 for _ in out.open()),
            "errors": sum(1 for _ in errors.open())}


def fake_engine_env(work: Path | None, prefix: str) -> tuple[Path, dict]:
    """The work folder (`work`, or a new temporary one) and the environment of batchjson commands on the fake
    engine: its model (FAKE, or a tokenizer-only model made in the folder), no GPU, this tree first on the path."""
    from bench.smoke import tokenizer_model

    work = work or Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    model = Path(os.environ[FAKE]) if os.environ.get(FAKE) else tokenizer_model(work / "model")
    return work, os.environ | {FAKE: str(model), "CUDA_VISIBLE_DEVICES": "",
                               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench openai-batch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", default="10000,100000", help="requests per file, comma-separated")
    ap.add_argument("--work", type=Path, help="where the files go (default: a temporary folder)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    work, env = fake_engine_env(args.work, "bench-openai-")
    rows = []
    for lines in (int(n) for n in args.lines.split(",")):
        rows.append(one(lines, work, env))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows, [("lines", "requests"), ("file_mb", "file MiB"), ("import_mb", "import peak RSS MiB"),
                       ("import_s", "import s"), ("export_mb", "export peak RSS MiB"), ("export_s", "export s"),
                       ("run_s", "run s (fake engine)"), ("answers", "answers"), ("errors", "errors")]))
    if args.out:
        dump(args.out, rows)
    return 0
