"""Throughput: batchjson against bare vLLM on the same rows and engine settings, CPU or GPU; its own cost per row.

    python -m bench compare  --model default --rows 80 --out bench-results/cpu-smollm2
    python -m bench sweep    --model /tmp/models/smollm2 --methods none,ngram,draft_model,suffix
    python -m bench scale    --tokenizer-from /tmp/models/smollm2
    python -m bench overhead --rows 10000,200000
    python -m bench gpu      --model /tmp/models/smollm2 --budget 530 --out $OUT   (the whole GPU plan)
    python -m bench report   FILE...

Every engine scenario runs in its own subprocess (`python -m bench _worker`, bench/scenarios.py) with its own
timeout, so one crash or hang loses only itself. Results go to OUT/<mode>.json; a short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

from bench.common import P1, P2, ROOT, WORK, dump, make_rows, run_isolated, table


class Budget:
    """A deadline shared by the scenarios of one invocation: each gets min(its own timeout, what is left)."""

    def __init__(self, seconds: float | None):
        self.deadline = time.monotonic() + seconds if seconds else None

    def left(self) -> float:
        return self.deadline - time.monotonic() if self.deadline else float("inf")


FAILED: list[str] = []  # the runs of this invocation that failed: the command then exits 1


def run_worker(kind: str, sc: dict, timeout: float, out: Path, budget: Budget, min_s: float = 20) -> dict:
    """Run one scenario in a fresh process group; a timeout kills the group (the engine core with it)."""
    timeout = min(timeout, budget.left() - 5)
    label = sc.get("label", kind)
    if timeout < min_s:
        print(f"[bench] {label}: skipped, {budget.left():.0f}s of the budget left", flush=True)
        return {"skipped": "no time left in the budget", "label": label}
    WORK.mkdir(parents=True, exist_ok=True)
    scen, result = WORK / f"sc-{os.getpid()}.json", WORK / f"res-{os.getpid()}.json"
    result.unlink(missing_ok=True)
    scen.write_text(json.dumps(sc, default=str))
    log = out / "workers.log"
    start = log.stat().st_size if log.exists() else 0
    t0 = time.monotonic()
    print(f"[bench] {label}: start (timeout {timeout:.0f}s)", flush=True)
    rc = run_isolated(["_worker", kind, str(scen), str(result)], timeout, log, label)
    wall = round(time.monotonic() - t0, 1)
    res = json.loads(result.read_text()) if result.exists() else {}
    if rc is None:
        res = {"error": f"timed out after {timeout:.0f}s", **res}
    elif rc != 0 and "error" not in res:
        res["error"] = f"worker exited with {rc}"
    res |= {"label": label, "worker_wall_s": wall}
    print(f"[bench] {label}: {'FAILED ' + res['error'] if 'error' in res else 'done'} in {wall}s", flush=True)
    if "error" in res:
        FAILED.append(f"{label}: {res['error']}")
        with open(log) as f:
            f.seek(start)
            print("".join(f.readlines()[-25:]), flush=True)
    return res


def _save(out: Path, name: str, data: dict) -> None:
    dump(out / f"{name}.json", data)


def model_dir(path: str) -> str:
    """A model folder for `path` ("default": the embedded SmolLM2, converted once)."""
    if path == "default":
        from batchjson.engine import resolve_model  # converts the embedded GGUF once; imports no vLLM

        return resolve_model("default")
    return str(Path(path).resolve())


def code_state() -> dict:
    """What was measured: a hash of batchjson/*.py and bench/*.py (the git commit too, where .git is there)."""
    import hashlib

    h = {}
    for folder in ("batchjson", "bench"):
        d = hashlib.sha256()
        for f in sorted((ROOT / folder).glob("*.py")):
            d.update(f.name.encode() + f.read_bytes())
        h[folder] = d.hexdigest()[:12]
    try:
        h["git"] = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                                  text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        h["git"] = None
    return h


def _norm(d):
    return json.loads(json.dumps(d, sort_keys=True, default=str))


# ---------------------------------------------------------------- compare

def compare(args, out: Path, budget: Budget) -> tuple[dict, list[str]]:
    """(a) bare llm.generate and (b) batchjson's run, on the same rows and engine kwargs, alternating order."""
    rows = make_rows(args.rows, WORK, seed=0)
    base = {"input": str(rows), "model": model_dir(args.model), "max_in_flight": args.max_in_flight,
            "method": args.method, "k": args.k, "engine": json.loads(args.engine)}
    if args.max_tokens:
        base["max_tokens"] = args.max_tokens
    runs = []
    for r in range(args.repeat):
        for side in (("bare", "batchjson") if r % 2 == 0 else ("batchjson", "bare")):
            sc = base | {"label": f"{args.tag}{side}#{r + 1}", "output": str(WORK / f"out-{side}")}
            runs.append(run_worker(side, sc, args.timeout, out, budget) | {"side": side, "repeat": r + 1})
            res = {"settings": base, "runs": runs, "summary": _compare_summary(runs), "code": code_state()}
            _save(out, f"{args.tag}compare", res)
    return res, _compare_table(res, args.tag)


def _median(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def _compare_summary(runs: list[dict]) -> dict:
    ok = {s: [r for r in runs if r.get("side") == s and "error" not in r and "skipped" not in r] for s in ("bare", "batchjson")}
    if not ok["bare"] or not ok["batchjson"]:
        return {"error": "a side has no successful run"}
    med = lambda side, key: _median([r.get(key) for r in ok[side]])  # noqa: E731
    bare_kw, bj_kw = _norm(ok["bare"][0]["llm_kwargs"]), _norm(ok["batchjson"][0]["llm_kwargs"])
    s = {"llm_kwargs_identical": bare_kw == bj_kw,
         "llm_kwargs_diff": {k: (bare_kw.get(k), bj_kw.get(k)) for k in set(bare_kw) | set(bj_kw)
                             if bare_kw.get(k) != bj_kw.get(k)},
         "sampling_identical": ok["bare"][0]["params"] == ok["batchjson"][0]["passes"][P1]["params"]}
    for key in ("rows_per_s", "output_tokens_per_s", "valid_per_s", "valid_per_s_end_to_end"):
        b, j = med("bare", key), med("batchjson", key)
        s[f"ratio_{key}"] = round(j / b, 3) if b else None
    s["ratio_pass1_valid_per_s"] = (round(med("batchjson", "pass1_valid_per_s") / med("bare", "valid_per_s"), 3)
                                    if med("bare", "valid_per_s") else None)
    return s


def _compare_table(res: dict, tag: str) -> list[str]:
    rows = []
    for r in res["runs"]:
        name = f"{r['label']}"
        if "error" in r or "skipped" in r:
            rows.append({"run": name, "rows": r.get("error") or r.get("skipped")})
            continue
        if r["side"] == "bare":
            rows.append({"run": name, "rows": r["rows"], "s": r["seconds"], "rows/s": r["rows_per_s"],
                         "tok/s": r["output_tokens_per_s"], "valid": r["valid"], "valid/s": r["valid_per_s"],
                         "acc": r["acceptance"], "start": r["engine_start_s"], "rss": r["runner_peak_rss_mb"],
                         "erss": r["engine_peak_rss_mb"]})
        else:
            p1 = r["passes"].get(P1, {})
            rows.append({"run": name + " pass1", "rows": r["rows"], "s": r["seconds"], "rows/s": r["rows_per_s"],
                         "tok/s": r["output_tokens_per_s"], "valid": r["pass1_valid"], "valid/s": r["pass1_valid_per_s"],
                         "acc": r["acceptance"], "start": p1.get("engine_start_s"), "rss": r["runner_peak_rss_mb"],
                         "erss": r["engine_peak_rss_mb"]})
            p2 = r["passes"].get(P2)
            rows.append({"run": name + " both passes", "rows": r["rows"], "s": r["both_passes_s"],
                         "tok/s": r["both_passes_output_tokens_per_s"], "valid": r["valid"], "valid/s": r["valid_per_s"],
                         "start": p2.get("engine_start_s") if p2 else None})
    cols = [("run", "run"), ("rows", "rows"), ("s", "decode s"), ("rows/s", "rows/s"), ("tok/s", "out tok/s"),
            ("valid", "valid"), ("valid/s", "valid/s"), ("acc", "accept"), ("start", "engine start s"),
            ("rss", "runner peak RSS MB"), ("erss", "engine peak RSS MB")]
    s = res["summary"]
    lines = [f"## {tag}compare: {res['settings']['model']}, {res['settings']['max_in_flight']} in flight, "
             f"speculation {res['settings']['method']}", table(rows, cols)]
    if "error" not in s:
        lines.append(f"batchjson/bare: rows/s x{s['ratio_rows_per_s']} (pass 1 vs generate), out tok/s "
                     f"x{s['ratio_output_tokens_per_s']}, valid rows/s x{s['ratio_valid_per_s']} (both passes' decode "
                     f"windows) / x{s['ratio_valid_per_s_end_to_end']} (end to end, engine starts included) / "
                     f"x{s['ratio_pass1_valid_per_s']} (pass 1 only); same vllm.LLM kwargs: {s['llm_kwargs_identical']}"
                     f"{'' if s['llm_kwargs_identical'] else ' ' + json.dumps(s['llm_kwargs_diff'])}; same sampling: "
                     f"{s['sampling_identical']}")
    return lines


# ---------------------------------------------------------------- sweep and scale

def _sweep(args, out: Path, budget: Budget, name: str, model: str, engine: dict, seed: int) -> tuple[dict, list[str]]:
    """One subprocess per method; results are saved after each, merged into OUT/<name>.json by method."""
    in_flight = [int(x) for x in args.in_flight.split(",")]
    need = 2 + sum(max(args.min_rows, args.waves * n) for n in in_flight)
    rows = make_rows(need, WORK, seed=seed)
    settings = {"model": model, "engine": engine, "in_flight": in_flight, "k": args.k, "waves": args.waves,
                "min_rows": args.min_rows, "max_tokens": args.max_tokens, "rows_file": rows.name}
    path = out / f"{name}.json"
    res = json.loads(path.read_text()) if path.exists() else {}
    if res.get("settings") != settings:  # only merge runs of the same settings (a later call adding methods)
        res = {"settings": settings, "results": []}
    for method in args.methods.split(","):
        sc = {"label": f"{name}-{method}", "input": str(rows), "model": model, "max_in_flight": max(in_flight),
              "method": method, "k": args.k, "engine": engine, "in_flight": in_flight, "waves": args.waves,
              "min_rows": args.min_rows, "max_tokens": args.max_tokens, "output": str(WORK / "out-sweep")}
        r = run_worker("sweep", sc, args.timeout, out, budget) | {"method": method}
        res["results"] = [x for x in res["results"] if x.get("method") != method] + [r]
        res |= {"winners": _winners(res["results"]), "code": code_state()}
        _save(out, name, res)
    return res, _sweep_table(res, name)


def _winners(results: list[dict]) -> dict:
    best: dict[int, tuple[float, str]] = {}
    for r in results:
        for p in r.get("points", []):
            if p["output_tokens_per_s"] > best.get(p["in_flight"], (0, ""))[0]:
                best[p["in_flight"]] = (p["output_tokens_per_s"], r["method"])
    return {n: m for n, (_, m) in sorted(best.items())}


def _sweep_table(res: dict, name: str) -> list[str]:
    rows = []
    for r in res["results"]:
        if "points" not in r:
            rows.append({"method": r.get("method") or r["label"], "rows": r.get("error") or r.get("skipped")})
            continue
        for p in r["points"]:
            rows.append(p | {"start": r["engine_start_s"], "erss": r["engine_peak_rss_mb"]})
    cols = [("method", "method"), ("in_flight", "in flight"), ("rows", "rows"), ("rows_per_s", "rows/s"),
            ("output_tokens_per_s", "out tok/s"), ("valid_per_s", "valid/s"), ("acceptance", "accept"),
            ("ms_per_step", "ms/step"), ("tokens_per_step", "tok/step"), ("truncated", "truncated"),
            ("start", "engine start s")]
    win = ", ".join(f"{n}: {m}" for n, m in res["winners"].items())
    st = res["settings"]
    return [f"## {name}: {st['model']} {st['engine'] or ''} k={st['k']} max_tokens={st['max_tokens'] or 'job'}",
            table(rows, cols),
            f"fastest (output tok/s) per in-flight size: {win}"]


def sweep(args, out, budget):
    return _sweep(args, out, budget, f"{args.tag}sweep", model_dir(args.model), json.loads(args.engine), seed=1)


LLAMA_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "head_dim": 128}


def make_shape_model(tokenizer_from: str, dst: Path, dims: dict) -> Path:
    """A Llama-shaped model folder with no weights (vLLM's load_format="dummy" fills them at random) and the
    tokenizer of `tokenizer_from`. Random weights measure cost per step, not quality or acceptance."""
    src = Path(tokenizer_from)
    cfg = json.loads((src / "config.json").read_text())
    cfg |= dims | {"tie_word_embeddings": False, "dtype": "bfloat16", "torch_dtype": "bfloat16"}
    cfg.pop("_model_name_or_path", None)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            (dst / f.name).write_bytes(f.read_bytes())
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def scale(args, out, budget):
    dims = json.loads(args.dims) if args.dims else LLAMA_7B
    model = make_shape_model(model_dir(args.tokenizer_from), WORK / f"shape-{dims['num_hidden_layers']}x{dims['hidden_size']}", dims)
    engine = {"load_format": "dummy", **json.loads(args.engine)}
    return _sweep(args, out, budget, f"{args.tag}scale", str(model), engine, seed=2)


# ---------------------------------------------------------------- overhead

def overhead(args, out, budget):
    sizes = [int(x) for x in args.rows.split(",")]
    files = {n: make_rows(n, WORK, seed=0) for n in sorted(set(sizes))}
    small = min(sizes)
    plan = [{"label": f"overhead-{n}", "rows": n} for n in sizes]
    plan += [{"label": f"overhead-{small}-stress", "rows": small, "fail_rate": 0.6, "fail_kinds": ["schema", "length"]},
             {"label": f"overhead-{small}-batch1024", "rows": small, "batch_size": 1024},
             {"label": f"overhead-{small}-profile", "rows": small, "profile": True}]
    if args.what_if:  # proposed runner changes, patched into the worker only (see overhead.what_if)
        w = args.what_if.split(",")
        plan += [{"label": f"what-if-{n}", "rows": n, "what_if": w} for n in sizes]
        plan += [{"label": f"what-if-{small}-batch1024", "rows": small, "batch_size": 1024, "what_if": w},
                 {"label": f"what-if-{small}-batch1024-profile", "rows": small, "batch_size": 1024, "what_if": w,
                  "profile": True}]
    runs = []
    for p in plan:
        sc = {"fail_rate": args.fail_rate, "fail_kinds": args.fail_kinds.split(","), **p,
              "input": str(files[p["rows"]]), "output": str(WORK / "out-overhead"), "model": args.model,
              "max_in_flight": args.max_in_flight}
        runs.append(run_worker("overhead", sc, args.timeout, out, budget, min_s=5) | p)
    ok = {r["label"]: r for r in runs if "error" not in r and "skipped" not in r}
    summary = {}
    for prefix in ("overhead", "what-if"):
        big, little = ok.get(f"{prefix}-{max(sizes)}"), ok.get(f"{prefix}-{small}")
        if big and little:
            summary[prefix] = {"rss_growth_mb": round(big["runner_peak_rss_mb"] - little["runner_peak_rss_mb"], 1),
                               "rows": [small, max(sizes)]}
    res = {"runs": runs, "summary": summary, "code": code_state()}
    _save(out, f"{args.tag}overhead", res)
    return res, _overhead_lines(res)


def _overhead_lines(res: dict) -> list[str]:
    runs, summary = res["runs"], res["summary"]
    cols = [("label", "run"), ("rows", "rows"), ("batch_size", "batch"), ("fail_rate", "pass-1 fail rate"),
            ("fail_kinds", "failures"), ("pass2_rows", "pass-2 rows"), ("wall_s", "wall s"), ("us_per_row_cpu", "CPU us/row"),
            ("us_per_row_wall", "wall us/row"), ("peak_before_tally", "peak RSS before tally MB"),
            ("runner_peak_rss_mb", "peak RSS MB"), ("tally_s", "tally s")]
    runs = [r | {"peak_before_tally": r.get("tally", {}).get("peak_before_mb"), "tally_s": r.get("tally", {}).get("wall_s"),
                 "fail_kinds": ",".join(r["fail_kinds"]) if isinstance(r.get("fail_kinds"), list) else r.get("fail_kinds"),
                 "label": r["label"] + (f" ({'+'.join(r['what_if'])})" if r.get("what_if") else "")} for r in runs]
    lines = ["## overhead: batchjson with a fake in-process engine (CPU per row outside the engine)",
             table([r for r in runs if not r.get("profile")], cols)]
    for prefix, sm in summary.items():
        lines.append(f"{prefix}: runner peak RSS growth {sm['rows'][0]} -> {sm['rows'][1]} rows: {sm['rss_growth_mb']} MB")
    for prof in (r for r in runs if r.get("profile") and "us_per_row_by_stage" in r):
        stages = [{"stage": k, "us": v} for k, v in sorted(prof["us_per_row_by_stage"].items(), key=lambda kv: -kv[1])]
        lines += [f"where it goes in {prof['label']} (cProfile; profiling inflates the total to "
                  f"{prof['profiled_total_us_per_row']} us/row):", table(stages, [("stage", "stage"), ("us", "us/row")]),
                  "direct timings (no profiler): " + ", ".join(f"{k} {v}" for k, v in prof.get("micro", {}).items())]
    return lines


def report(args, out, budget):
    """Print the tables of result files again (compare summaries recomputed), e.g. for BENCHMARKS.md."""
    lines = []
    for f in args.files:
        res, name = json.loads(Path(f).read_text()), Path(f).stem
        if name.endswith("compare"):
            res["summary"] = _compare_summary(res["runs"])
            lines += _compare_table(res, name[: -len("compare")])
        elif name.endswith("overhead"):
            lines += _overhead_lines(res)
        else:
            lines += _sweep_table(res, name)
        lines.append(f"(code: {json.dumps(res.get('code'))})")
    return {}, lines


# ---------------------------------------------------------------- the GPU plan

def gpu(args, out, budget):
    """The GPU plan, most needed first: compare; sweep none+ngram; scale none; sweep draft+suffix; scale ngram.

    Each step's results are saved as it ends, so what ran is kept when the budget or the call's limit cuts the
    rest; a later call with --only/--methods adds the missing methods to the same files.
    """
    s = args.smoke
    ns = argparse.Namespace
    base = dict(model=args.model, k=4, engine="{}", tag="gpu-")
    methods, scale_methods = args.methods.split(","), args.scale_methods.split(",")
    first = [m for m in methods if m in ("none", "ngram")]
    later = [m for m in methods if m not in first]
    sweep_args = dict(base, timeout=150, in_flight="1,4" if s else "1,16,128,512", waves=2, min_rows=4,
                      max_tokens=48 if s else None)
    scale_args = dict(base, timeout=200, tokenizer_from=args.model, in_flight="1,4" if s else "1,64,256", waves=1,
                      min_rows=2, max_tokens=48 if s else 128,
                      dims=json.dumps({"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                                       "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64}) if s else "")
    steps = [("compare", compare, ns(**base, timeout=240, rows=16 if s else 600, max_in_flight=8 if s else 256,
                                     method="ngram", max_tokens=48 if s else None, repeat=1)),
             ("sweep", sweep, ns(**sweep_args, methods=",".join(first))),
             ("scale", scale, ns(**scale_args, methods=scale_methods[0])),
             ("sweep", sweep, ns(**sweep_args, methods=",".join(later))),
             ("scale", scale, ns(**scale_args, methods=",".join(scale_methods[1:])))]
    only = set(args.only.split(",")) if args.only else None
    tables: dict[str, list[str]] = {}
    for name, fn, a in steps:
        if (only and name not in only) or not getattr(a, "methods", "all"):
            continue
        tables[name] = fn(a, out, budget)[1]
    return {}, [line for lines in tables.values() for line in lines]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)

    def add(name, help_):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--out", default=str(WORK / "results"), help="folder for <mode>.json and workers.log")
        p.add_argument("--budget", type=float, default=None, help="seconds for the whole invocation")
        p.add_argument("--tag", default="", help="prefix for result names")
        return p

    c = add("compare", "bare llm.generate vs batchjson on the same rows and engine kwargs")
    c.add_argument("--model", default="default", help='model folder, or "default" (SmolLM2-135M-Instruct)')
    c.add_argument("--rows", type=int, default=80)
    c.add_argument("--max-in-flight", type=int, default=64, help="batchjson max_in_flight = vLLM max_num_seqs")
    c.add_argument("--method", default="ngram", help="speculation: none, ngram, draft_model, suffix")
    c.add_argument("--k", type=int, default=4)
    c.add_argument("--max-tokens", type=int, default=None, help="pass-1 max_tokens (default: the sample job's)")
    c.add_argument("--engine", default="{}", help="extra vllm.LLM kwargs as JSON, for both sides")
    c.add_argument("--repeat", type=int, default=1, help="alternate bare/batchjson this many times (noisy CPUs)")
    c.add_argument("--timeout", type=float, default=600, help="seconds per side")

    for name, help_ in (("sweep", "speculation methods x in-flight sizes"),
                        ("scale", "the sweep on a random-weight model of a real shape (default Llama-2-7B)")):
        s = add(name, help_)
        if name == "sweep":
            s.add_argument("--model", default="default")
            s.add_argument("--methods", default="none,ngram,draft_model,suffix")
            s.add_argument("--in-flight", default="1,16,128,512")
            s.add_argument("--max-tokens", type=int, default=None)
        else:
            s.add_argument("--tokenizer-from", default="default", help="model folder whose tokenizer and config base are used")
            s.add_argument("--dims", default="", help="config overrides as JSON (default: Llama-2-7B's)")
            s.add_argument("--methods", default="none,ngram")
            s.add_argument("--in-flight", default="1,64,256")
            s.add_argument("--max-tokens", type=int, default=128)
        s.add_argument("--k", type=int, default=4)
        s.add_argument("--waves", type=int, default=2, help="rows per in-flight size = waves x size")
        s.add_argument("--min-rows", type=int, default=4)
        s.add_argument("--engine", default="{}")
        s.add_argument("--timeout", type=float, default=600, help="seconds per method")

    o = add("overhead", "batchjson's CPU cost per row outside the engine, and RSS at 10k vs 200k rows")
    o.add_argument("--rows", default="10000,200000")
    o.add_argument("--model", default="default", help="the model whose tokenizer frames the prompts (no weights are read)")
    o.add_argument("--fail-rate", type=float, default=0.11,
                   help="share of pass-1 rows the fake engine fails (0.11: SmolLM2 on the H200, sample task)")
    o.add_argument("--fail-kinds", default="repetition", help="failures to cycle: repetition, length, schema")
    o.add_argument("--max-in-flight", type=int, default=256)
    o.add_argument("--timeout", type=float, default=300)
    o.add_argument("--what-if", default="", help="also run with proposed runner changes patched in: rs_validator")

    g = add("gpu", "the whole GPU plan: compare, sweep, scale, within --budget")
    g.add_argument("--model", default="default")
    g.add_argument("--methods", default="none,ngram,draft_model,suffix", help="sweep methods")
    g.add_argument("--scale-methods", default="none,ngram", help="methods on the 7B-shaped model; the first runs early")
    g.add_argument("--only", default="", help="comma list of compare,sweep,scale")
    g.add_argument("--smoke", action="store_true", help="tiny sizes, to dry-run the plan on CPU")

    r = add("report", "print the tables of saved result files")
    r.add_argument("files", nargs="+")

    w = sub.add_parser("_worker")
    w.add_argument("kind")
    w.add_argument("scenario", type=Path)
    w.add_argument("result", type=Path)

    args = ap.parse_args(argv)
    if args.mode == "_worker":
        from bench.scenarios import main as worker_main

        return worker_main(args.kind, args.scenario, args.result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget)
    t0 = time.monotonic()
    _, lines = {"compare": compare, "sweep": sweep, "scale": scale, "overhead": overhead, "gpu": gpu,
                "report": report}[args.mode](
        args, out, budget)
    print(f"\n# bench {args.mode} finished in {time.monotonic() - t0:.0f}s; results in {out}\n", flush=True)
    print("\n\n".join(lines), flush=True)
    if FAILED:
        print(f"\n# {len(FAILED)} run(s) failed (see {out / 'workers.log'}):\n  " + "\n  ".join(FAILED), flush=True)
        return 1
    return 0

