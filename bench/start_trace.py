"""Where a run's time goes before its engine decodes: `batchjson run` with its main thread's stack sampled.

    python -m bench start-trace JOB.toml --output DIR [--every 0.1] [--out trace.json]

Runs `batchjson run JOB --output DIR --fresh` in this process (the user's command line, its fast exit too),
sampling the main thread's stack every `--every` seconds from another thread (cheap: no tracing hook), and prints
the run as segments: from when to when the main thread was in which batchjson function, and which module it was
importing there (the outermost import in the stack). The engine's own processes are not sampled; the time the
runner waits on them shows as the batchjson frame that waits (the engine's start). The segments and every sample
go to --out as JSON.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import threading
import time

from bench.common import FAKE


def _where(frame) -> tuple[str, str]:
    """(the innermost batchjson function, the outermost module being imported) of a stack."""
    ours, importing = "", ""
    while frame is not None:
        code = frame.f_code
        if not ours and "/batchjson/" in code.co_filename:
            ours = f"{code.co_filename.rsplit('/batchjson/', 1)[1]}:{code.co_name}"
        if code.co_name == "_find_and_load" and "importlib" in code.co_filename:
            importing = str(frame.f_locals.get("name", importing))  # outermost wins: the walk goes outwards
        frame = frame.f_back
    return ours, importing


def segments(samples: list[tuple[float, str, str]]) -> list[dict]:
    """Consecutive samples with the same (function, import) as one segment."""
    out: list[dict] = []
    for t, ours, importing in samples:
        if out and out[-1]["in"] == ours and out[-1]["importing"] == importing:
            out[-1]["to"] = t
        else:
            out.append({"from": t, "to": t, "in": ours, "importing": importing})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench start-trace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job")
    ap.add_argument("--output", required=True)
    ap.add_argument("--every", type=float, default=0.1)
    ap.add_argument("--out", default=None, help="JSON file for the segments and samples")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    main_thread = threading.main_thread().ident
    samples: list[tuple[float, str, str]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(args.every):
            frame = sys._current_frames().get(main_thread)
            if frame is not None:
                samples.append((round(time.monotonic() - t0, 2), *_where(frame)))

    def write() -> None:  # an exit handler: batchjson's command ends the process itself once they have run
        done.set()
        segs = [s for s in segments(samples) if s["to"] - s["from"] >= args.every or s["importing"]]
        for s in segs:
            print(f"{s['from']:7.2f} - {s['to']:7.2f}  {s['in'] or '-':45s} {s['importing']}", file=sys.stderr)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"segments": segs, "samples": samples}, f)

    threading.Thread(target=sample, daemon=True).start()
    atexit.register(write)
    sys.argv = ["batchjson", "run", args.job, "--output", args.output, "--fresh"]
    if os.environ.get(FAKE):  # the smoke: the fake engine's twin of the command
        from bench.fakerun import main as command
    else:
        from batchjson.cli import entry as command
    command()
    return 0


if __name__ == "__main__":
    sys.exit(main())
