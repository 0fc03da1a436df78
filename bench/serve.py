"""`batchjson serve` against the commands it is built on: one requests file through the server (upload, create, poll,
download, with the official `openai` client) and through `import-openai`, `run` and `export-openai`, on the fake
engine (BENCHMARKS.md, "The Batch API server").

    python -m bench serve [--lines 10000] [--work DIR] [--out FILE]
    python -m bench.serve server STATE PORT       (the server on the fake engine, as this benchmark starts it)

The commands are bench/openai_batch.py's (each its own process, as a user runs them); the same three functions also
run in this process once its imports are done (the server's own cost against them: upload, checks, HTTP, polling).
The server is started once; its first batch counts from the server's launch (a cold start, as the commands pay
theirs), its second from the upload (a server already up, as one runs overnight). Each checks that the files hold
each request once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.common import FAKE, dump, table


def fake_engines():
    """bench/fakerun.py's fake engine: the sample task's answers, 80% of pass 1 valid."""
    from batchjson.engine.fake import Answer, FakeEngines
    from bench.overhead import FAILURES, VALID

    return FakeEngines(valid=0.8, cycle=True, prompt_tokens=300, answers=[Answer(v, "stop", 90) for v in VALID],
                       failures=list(FAILURES.values()))


def server(argv: list[str]) -> None:
    """The server on the fake engine."""
    from batchjson.serve import serve

    serve(argv[0], port=int(argv[1]), model=os.environ[FAKE], engine_factory=fake_engines(), log_level="warning")


def in_process(requests: Path, work: Path, model: str) -> float:
    """import_requests, run_job and export_results in this process: seconds."""
    from batchjson.api import load_job, run_job
    from batchjson.openai_batch import export_results, import_requests

    t = time.monotonic()
    imported = import_requests(requests, work / "jobs", model=model)
    for name in imported.jobs:
        run_job(load_job(work / "jobs" / name / "job.toml"), engine_factory=fake_engines(), progress=False)
    export_results(work / "jobs", work / "out.jsonl", work / "errors.jsonl")
    return time.monotonic() - t


def _up(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url + "/files", timeout=5).read()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the server did not start (exit {proc.poll()})")
            time.sleep(0.05)


def through_server(client, requests: Path, lines: int) -> dict:
    """Upload, create, poll every 0.2 s, download: seconds, and the answers and errors."""
    t = time.monotonic()
    with requests.open("rb") as f:
        upload = client.files.create(file=f, purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.2)
    if batch.status != "completed":
        sys.exit(f"the batch ended {batch.status}: {batch.errors}")
    files = [client.files.content(f).text.splitlines() for f in (batch.output_file_id, batch.error_file_id) if f]
    seconds = time.monotonic() - t
    ids = [json.loads(line)["custom_id"] for text in files for line in text]
    if sorted(ids, key=lambda i: int(i.split("-")[1])) != [f"invoice-{i}" for i in range(lines)]:
        sys.exit(f"{lines} lines through the server: the files do not hold each request once")
    return {"s": seconds, "answers": batch.request_counts.completed, "errors": batch.request_counts.failed}


def main(argv: list[str]) -> int:
    from openai import OpenAI

    from batchjson.serve import listen
    from bench.openai_batch import fake_engine_env, one, write_requests

    ap = argparse.ArgumentParser(prog="python -m bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=10000, help="requests in the file")
    ap.add_argument("--work", type=Path, help="where the files go (default: a temporary folder)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    work, env = fake_engine_env(args.work, "bench-serve-")
    commands = one(args.lines, work / "commands", env)
    commands_s = commands["import_s"] + commands["run_s"] + commands["export_s"]
    requests = work / "commands" / f"lines-{args.lines}" / "requests.jsonl"
    if not requests.exists():
        write_requests(requests, args.lines)
    in_process(requests, work / "warm-up", env[FAKE])  # the imports (xgrammar, torch) paid once, not timed
    functions_s = in_process(requests, work / "functions", env[FAKE])
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    url = f"http://127.0.0.1:{port}/v1"
    launched = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "bench.serve", "server", str(work / "state"), str(port)], env=env)
    try:
        _up(url, proc)
        up_s = time.monotonic() - launched
        client = OpenAI(base_url=url, api_key="unused", max_retries=0)
        cold = through_server(client, requests, args.lines)
        cold["s"] += up_s
        warm = through_server(client, requests, args.lines)
    finally:
        proc.terminate()
        proc.wait(60)
    rows = [{"way": "import-openai + run + export-openai (3 processes)", "s": commands_s,
             "answers": commands["answers"], "errors": commands["errors"]},
            {"way": "import_requests + run_job + export_results (one process, imports done)", "s": functions_s},
            {"way": "serve: launched, then upload to download", "s": cold["s"], "answers": cold["answers"],
             "errors": cold["errors"]},
            {"way": "serve: already up, upload to download", "s": warm["s"], "answers": warm["answers"],
             "errors": warm["errors"]}]
    for row in rows:
        row["x"], row["x_functions"] = row["s"] / commands_s, row["s"] / functions_s
        print(json.dumps(row), flush=True)
    print(f"{args.lines} requests; the commands: import {commands['import_s']:.1f} s, run {commands['run_s']:.1f} s, "
          f"export {commands['export_s']:.1f} s; the server was up {up_s:.1f} s after its launch")
    print(table(rows, [("way", "way"), ("s", "wall s"), ("x", "x the commands"),
                       ("x_functions", "x the functions"), ("answers", "answers"),
                       ("errors", "errors")]))
    if args.out:
        dump(args.out, {"lines": args.lines, "up_s": up_s, "commands": commands, "rows": rows})
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["server"]:
        server(sys.argv[2:])
    else:
        sys.exit(main(sys.argv[1:]))
