"""The newcomer's first command, measured: the sample job against bare vLLM on the same rows and settings (CPU).

    python -m bench cpu-sample --out bench-results/cpu-sample.json             # bare, then `batchjson run`
    python -m bench cpu-sample --sides bare,batchjson,bare --hog 1             # the same beside a busy core
    python -m bench cpu-sample --sides batchjson --env OMP_NUM_THREADS=1       # a setting tried on both sides

Each side runs in its own process, as a user runs it: `bare` imports vLLM, starts `vllm.LLM` with the engine
settings batchjson gives the sample job (xgrammar, whitespace off, eager on CPU, the job's seed) and decodes the sample
job's rendered prompts in one `llm.generate` with pass 1's sampling (greedy, max_tokens, the loop guard); `batchjson`
is `batchjson run jobs/sample.toml` on a fresh output folder. Both report import, engine start and decode seconds, and
the whole wall. `--hog N` keeps N busy-looping processes beside the run (another job on the machine).
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

from bench.common import JOB, run_cli


def bare(rows: int | None) -> dict:
    """Bare vLLM, in this process: the sample job's prompts and pass-1 settings, one llm.generate."""
    t0 = time.monotonic()
    from batchjson.engine import resolve_model
    from batchjson.schema.grammar import choose
    from batchjson.prompts import Renderer, chat_frame
    from batchjson.source import ParquetSource
    from batchjson.spec import load_spec

    spec = load_spec(str(JOB))
    model = resolve_model(spec.model.path)
    source = ParquetSource(spec.input, spec.prompt.columns)
    source.check()
    renderer = Renderer(spec.prompt, chat_frame(model, spec.prompt.system), spec.input.id_column,
                        spec.input.passthrough, {})
    prompts = [p.text for ref in source.plan() for p in renderer.render(source.unit(ref))][:rows]
    backend = choose(spec.schema_doc, spec.model.structured_output_backend, spec.model.disable_any_whitespace)
    t1 = time.monotonic()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    import vllm
    from vllm.sampling_params import RepetitionDetectionParams, StructuredOutputsParams

    t2 = time.monotonic()
    llm = vllm.LLM(model=model, dtype=os.environ.get("BENCH_DTYPE", "auto"), max_model_len=spec.model.max_model_len, enforce_eager=True, seed=spec.fallback.seed,
                   structured_outputs_config={"backend": backend.backend, "disable_any_whitespace": True},
                   max_num_seqs=spec.model.max_in_flight)
    t3 = time.monotonic()
    s = spec.sampling
    guard = s.repetition_detection or None
    params = vllm.SamplingParams(temperature=s.temperature, max_tokens=s.max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=backend.grammar_schema),
                                 **({"repetition_detection": RepetitionDetectionParams(**guard)} if guard else {}))
    outs = llm.generate(prompts, params, use_tqdm=False)
    t4 = time.monotonic()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"rows": len(prompts), "output_tokens": tokens, "prepare_s": round(t1 - t0, 1),
            "import_s": round(t2 - t1, 1), "start_s": round(t3 - t2, 1), "decode_s": round(t4 - t3, 1),
            "tok_per_s": round(tokens / (t4 - t3), 1), "wall_s": round(t4 - t0, 1)}


def batchjson(env: dict) -> dict:
    """`batchjson run` on the sample job, as a user runs it, into a fresh folder."""
    out = Path(tempfile.mkdtemp(prefix="bj-sample-"))
    t0 = time.monotonic()
    rc, report, tail = run_cli(JOB, out, env=env)
    wall = time.monotonic() - t0
    if report is None:
        return {"error": f"exit {rc}", "stderr": tail}
    res = {"wall_s": round(wall, 1), "report_s": report["seconds"], "valid": report["valid"]}
    for name, stats in report.get("passes", {}).items():
        res[name] = {k: stats[k] for k in ("rows", "valid", "seconds", "output_tokens") if k in stats}
        for trial in (stats.get("auto") or [{}])[0].get("trials", []):
            res[name] |= {"decode_tok_per_s": trial["output_tokens_per_s"], "engine_start_s": trial["engine_start_s"]}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench cpu-sample", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sides", default="bare,batchjson", help="comma-separated, run in this order")
    ap.add_argument("--rows", type=int, default=None, help="bare: the first N rows only")
    ap.add_argument("--hog", type=int, default=0, help="busy-looping processes beside the run")
    ap.add_argument("--env", action="append", default=[], help="K=V for both sides (repeatable)")
    ap.add_argument("--out", default=None, help="append the results as one JSON line to this file")
    ap.add_argument("_side", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._side == "bare":
        print(json.dumps(bare(args.rows)))
        return 0
    env = os.environ | dict(kv.split("=", 1) for kv in args.env)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hog)]
    results = []
    try:
        for side in args.sides.split(","):
            if side == "bare":
                cmd = [sys.executable, "-m", "bench", "cpu-sample", "bare"] + (["--rows", str(args.rows)] if args.rows else [])
                t0 = time.monotonic()
                p = subprocess.run(cmd, capture_output=True, text=True, env=env)
                lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
                res = json.loads(lines[-1]) if lines else {"error": f"exit {p.returncode}", "stderr": p.stderr[-3000:]}
                res["process_wall_s"] = round(time.monotonic() - t0, 1)
            else:
                res = batchjson(env)
            res = {"side": side, "hog": args.hog, "env": args.env, **res}
            results.append(res)
            print(json.dumps(res), flush=True)
    finally:
        for h in hogs:
            h.kill()
    if args.out:
        with open(args.out, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    return 1 if any("error" in r for r in results) else 0

