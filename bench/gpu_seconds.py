"""GPU-seconds per valid row: the loop guard, the fallback recipe and start-up, on tasks with ground truth.

    python bench/gpu_seconds.py before    --model M --rows 600 --out OUT   bare vLLM per task (cold start first)
    python bench/gpu_seconds.py batchjson --model M --rows 600 --out OUT   `batchjson run` per task, timestamped
    python bench/gpu_seconds.py guard     --model M --rows 600 --out OUT   offline loop-guard scan of the bare
                                          outputs, then one engine: pass 1 with the chosen guard, fallback recipes
    python bench/gpu_seconds.py scan      OUT/bare-outputs.json.gz --model M   the offline scan alone (CPU)
    python bench/gpu_seconds.py cost      OUT/bare-outputs.json.gz            the loop check's cost per token (CPU)
    python bench/gpu_seconds.py tables    OUT/*.json                          print the tables again

Tasks are bench/tasks.py's A, B, C. Each engine scenario runs in its own process with its own timeout; results go
to OUT/<mode>.json (the bare outputs, token ids included, to OUT/bare-outputs.json.gz); a short table is printed
last. Timestamps are wall-clock seconds since the parent launched the worker process.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from common import dump, table  # noqa: E402
from tasks import TASKS, schema, score, write_task  # noqa: E402

WORK = Path(os.environ.get("BATCHJSON_BENCH_WORK", "/tmp/batchjson-bench")) / "gs"
# Candidate loop guards: (max_pattern_size, min_pattern_size, min_count).
CANDIDATES = [(8, 1, 6), (16, 1, 4), (16, 2, 4), (24, 1, 3), (32, 2, 3), (48, 1, 4), (64, 1, 3), (64, 8, 3),
              (96, 16, 2)]
# Pass-2 recipes on the rows that fail pass 1 (with the chosen guard); "guard" is filled in with it.
FALLBACK = {"temperature": 0.7, "top_p": 1.0, "repetition_penalty": 1.1, "seed": 0, "max_tokens": 512}
RECIPES = [("default", {}), ("n2", {"n": 2}), ("n4", {"n": 4}), ("budget1024", {"max_tokens": 1024}),
           ("no-guard (current code)", {"guard": None}), ("top_p0.95", {"top_p": 0.95})]
ENGINE_LOG = re.compile(r"took|takes|finished in|KV cache size|Maximum concurrency|max_num_seqs|Capturing CUDA|Dynamo bytecode")


# ---------------------------------------------------------------- parent side

def spawn(kind: str, sc: dict, timeout: float, out: Path) -> dict:
    """One worker process in its own process group; its log goes to OUT/workers.log."""
    WORK.mkdir(parents=True, exist_ok=True)
    scen, res = WORK / f"sc-{kind}.json", WORK / f"res-{kind}.json"
    res.unlink(missing_ok=True)
    log = out / "workers.log"
    label = sc.get("label", kind)
    print(f"[gs] {label}: start (timeout {timeout:.0f}s)", flush=True)
    with open(log, "a") as f:
        f.write(f"\n===== {label} {time.strftime('%H:%M:%S')} =====\n")
        f.flush()
        start = f.tell()
        sc = sc | {"t_launch": time.time(), "partial": str(res)}
        scen.write_text(json.dumps(sc))
        env = os.environ | {"VLLM_LOGGING_LEVEL": os.environ.get("GS_VLLM_LOG", "INFO")}
        p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "_worker", kind, str(scen), str(res)],
                             stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    wall = round(time.time() - sc["t_launch"], 1)
    r = json.loads(res.read_text()) if res.exists() else {}
    if rc is None:
        r["error"] = f"timed out after {timeout:.0f}s"
    elif rc != 0 and "error" not in r:
        r["error"] = f"worker exited with {rc}"
    with open(log) as f:
        f.seek(start)
        lines = f.read().splitlines()
    r["engine_log"] = [ln[-220:] for ln in lines if ENGINE_LOG.search(ln)][:40]
    r |= {"label": label, "worker_wall_s": wall, **{k: sc[k] for k in ("task", "cold") if k in sc}}
    print(f"[gs] {label}: {'FAILED ' + r['error'] if 'error' in r else 'done'} in {wall}s", flush=True)
    if "error" in r:
        print("\n".join(lines[-30:]), flush=True)
    return r


def _time_left(deadline: float) -> float:
    return deadline - time.monotonic()


def before(args, out: Path) -> tuple[dict, list[str]]:
    """Bare vLLM per task (import, LLM(), one generate), after one cold start that fills the compile cache."""
    deadline = time.monotonic() + args.budget
    runs = []
    plan = ([{"task": args.tasks[-1], "label": f"bare-{args.tasks[-1]} (cold: first start on this machine)",
              "cold": True}] if args.cold else []) + [{"task": t, "label": f"bare-{t}"} for t in args.tasks]
    outputs = {}
    for p in plan:
        left = _time_left(deadline) - 5
        if left < 30:
            runs.append(p | {"skipped": "budget"})
            continue
        sc = p | {"model": args.model, "rows": args.rows, "max_tokens": args.max_tokens, "keep_outputs": not p.get("cold"),
                  "bounded": args.bounded}
        r = spawn("bare", sc, min(args.timeout, left), out)
        if "outputs" in r:
            outputs[p["task"]] = r.pop("outputs")
        runs.append(r)
        for folder in (out, WORK):
            dump(folder / "before.json", {"runs": runs, "settings": vars(args) | {"out": str(out)}})
    if outputs:
        with gzip.open(out / "bare-outputs.json.gz", "wt") as f:
            json.dump(outputs, f)
        with gzip.open(WORK / "bare-outputs.json.gz", "wt") as f:
            json.dump(outputs, f)
    return {"runs": runs}, before_table(runs)


def before_table(runs: list[dict]) -> list[str]:
    rows = [{k: r.get(k) for k in ("label", "rows", "valid", "correct", "field_acc", "length_capped", "output_tokens",
                                   "interpreter_s", "import_vllm_s", "from_vllm_import_LLM_s", "llm_init_s",
                                   "to_first_request_s", "generate_s", "whole_s")} | {"err": r.get("error")}
            for r in runs]
    cols = [("label", "run"), ("rows", "rows"), ("valid", "valid"), ("correct", "correct"), ("field_acc", "field acc"),
            ("length_capped", "cut at max_tokens"), ("output_tokens", "out tokens"), ("interpreter_s", "python s"),
            ("import_vllm_s", "import vllm s"), ("from_vllm_import_LLM_s", "from vllm import LLM s"),
            ("llm_init_s", "LLM() s"), ("to_first_request_s", "to 1st request s"), ("generate_s", "generate s"),
            ("whole_s", "whole s"), ("err", "error")]
    return ["## bare vLLM per task (import + LLM() + one generate)", table(rows, cols)]


def batchjson_runs(args, out: Path) -> tuple[dict, list[str]]:
    deadline = time.monotonic() + args.budget
    runs = []
    for t in args.tasks:
        left = _time_left(deadline) - 5
        if left < 30:
            runs.append({"task": t, "label": f"batchjson-{t}", "skipped": "budget"})
            continue
        sc = {"task": t, "label": f"batchjson-{t}", "model": args.model, "rows": args.rows,
              "max_tokens": args.max_tokens, "extra": args.extra, "bounded": args.bounded}
        runs.append(spawn("batchjson", sc, min(args.timeout, left), out))
        dump(out / f"{args.tag}batchjson.json", {"runs": runs, "settings": vars(args) | {"out": str(out)}})
    return {"runs": runs}, batchjson_table(runs)


def batchjson_table(runs: list[dict]) -> list[str]:
    rows, steps = [], []
    for r in runs:
        p1, p2 = (r.get("report") or {}).get("passes", {}).get("pass1", {}), (r.get("report") or {}).get("passes", {}).get("pass2", {})
        rows.append({"label": r.get("label"), "valid": r.get("valid"), "correct": r.get("correct"),
                     "p1_valid": p1.get("valid"), "p1_cut": (p1.get("reasons") or {}).get("truncated"),
                     "p1_rep": (p1.get("reasons") or {}).get("repetition"), "p2_rows": p2.get("rows"),
                     "p2_valid": p2.get("valid"), "first": r.get("to_first_request_s"), "p1": r.get("pass1_s"),
                     "p2": r.get("pass2_s"), "p2_start": r.get("pass2_engine_start_s"), "whole": r.get("whole_s"),
                     "err": r.get("error")})
        if r.get("startup"):
            steps.append({"label": r.get("label"), **r["startup"]})
    cols = [("label", "run"), ("valid", "valid"), ("correct", "correct"), ("p1_valid", "pass-1 valid"),
            ("p1_cut", "pass-1 cut at max_tokens"), ("p1_rep", "pass-1 repetition"), ("p2_rows", "pass-2 rows"),
            ("p2_valid", "pass-2 valid"), ("first", "to 1st request s"), ("p1", "pass 1 s"), ("p2", "pass 2 s"),
            ("p2_start", "pass-2 engine start s"), ("whole", "whole s"), ("err", "error")]
    lines = ["## batchjson run per task (CLI, in-process, timestamped)", table(rows, cols)]
    if steps:
        keys = list(dict.fromkeys(k for s in steps for k in s if k != "label"))
        lines += ["### start-up steps (s)", table(steps, [("label", "run")] + [(k, k) for k in keys])]
    return lines


# ---------------------------------------------------------------- loop-guard scan (CPU)

def stop_at(ids: list[int], params) -> int | None:
    """The output length at which vLLM's check would stop this output, or None.

    The scheduler checks after each new token, but only when the row did not end on that token for another
    reason (EOS or max_tokens come first), so the last token is never checked. This is
    vllm.v1.core.sched.utils.check_sequence_repetition(ids[:n], params) for each n, without the copies;
    `_scan_one` checks that both agree on a sample.
    """
    lo, hi, count = max(1, params.min_pattern_size), params.max_pattern_size, params.min_count
    for n in range(1, len(ids)):
        for size in range(lo, hi + 1):
            if size * count > n:
                break
            if ids[n - 1] != ids[n - 1 - size]:  # the common case, checked first
                continue
            if all(ids[n - k] == ids[n - k - size * m] for k in range(1, size + 1) for m in range(1, count)):
                return n
    return None


def stop_at_vllm(ids: list[int], params) -> int | None:
    from vllm.v1.core.sched.utils import check_sequence_repetition

    return next((n for n in range(1, len(ids)) if check_sequence_repetition(ids[:n], params)), None)


def guard_cost(args, out: Path):
    """What vLLM's loop check costs the scheduler: check_sequence_repetition after every token of every saved
    output, on the growing list as the scheduler keeps it; microseconds per output token, per guard."""
    from vllm.sampling_params import RepetitionDetectionParams
    from vllm.v1.core.sched.utils import check_sequence_repetition

    with gzip.open(args.files[0], "rt") as f:
        outputs = [r["ids"] for rows in json.load(f).values() for r in rows]
    res = {}
    for guard in [(64, 8, 3), (16, 2, 4), (16, 1, 4)]:
        params = RepetitionDetectionParams(**dict(zip(("max_pattern_size", "min_pattern_size", "min_count"), guard)))
        tokens, a = 0, time.perf_counter()
        for ids in outputs:
            grown = []
            for t in ids:
                grown.append(t)
                check_sequence_repetition(grown, params)
            tokens += len(ids)
        res[str(guard)] = round((time.perf_counter() - a) / tokens * 1e6, 2)
    dump(out / "guard-cost.json", {"outputs": len(outputs), "us_per_token": res})
    return res, ["\n".join(["| guard | µs per output token |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in res.items()])]


def _scan_one(job):
    from vllm.sampling_params import RepetitionDetectionParams

    cand, rows = job
    params = RepetitionDetectionParams(max_pattern_size=cand[0], min_pattern_size=cand[1], min_count=cand[2])
    stops = [stop_at(r["ids"], params) for r in rows]
    for r, st in list(zip(rows, stops))[::50]:
        assert stop_at_vllm(r["ids"], params) == st, (cand, r["id"])
    return cand, stops


def scan(outputs: dict, workers: int = 1) -> dict:
    """Each candidate against every bare output of every task: what it stops, how early, and what it stops wrongly."""
    jobs = [(c, outputs[t]) for c in CANDIDATES for t in outputs]
    if workers > 1:
        from multiprocessing import Pool

        with Pool(workers) as pool:
            results = pool.map(_scan_one, jobs)
    else:
        results = list(map(_scan_one, jobs))
    res: dict = {}
    for (cand, stops), (_, task) in zip(results, [(c, t) for c in CANDIDATES for t in outputs]):
        rows = outputs[task]
        failed = [(r, s) for r, s in zip(rows, stops) if not r["valid"]]
        ok = [(r, s) for r, s in zip(rows, stops) if r["valid"]]
        caught = [s for r, s in failed if s]
        res.setdefault(str(cand), {})[task] = {
            "failed": len(failed), "failed_stopped": len(caught),
            "failed_length_capped": sum(r["finish"] == "length" for r, _ in failed),
            "mean_stop": round(sum(caught) / len(caught), 1) if caught else None,
            "tokens_failed": sum(len(r["ids"]) for r, _ in failed),
            "tokens_saved": sum(len(r["ids"]) - s for r, s in failed if s) + sum(len(r["ids"]) - s for r, s in ok if s),
            "tokens_all": sum(len(r["ids"]) for r in rows),
            "valid": len(ok), "valid_stopped": sum(1 for _, s in ok if s),
            "correct": sum(r["correct"] for r, _ in ok), "correct_stopped": sum(1 for r, s in ok if s and r["correct"]),
            "valid_stopped_examples": [r["text"][:160] for r, s in ok if s][:4]}
    return res


def choose(scanned: dict) -> tuple[int, int, int]:
    """Fewest correct rows stopped, then fewest valid rows stopped within one of the best, then most tokens saved."""
    def total(c, k):
        return sum(t[k] for t in scanned[c].values())

    best_correct = min(total(c, "correct_stopped") for c in scanned)
    pool = [c for c in scanned if total(c, "correct_stopped") == best_correct]
    best_valid = min(total(c, "valid_stopped") for c in pool)
    slack = max(1, sum(t["valid"] for t in next(iter(scanned.values())).values()) // 1000)
    pool = [c for c in pool if total(c, "valid_stopped") <= best_valid + slack]
    pick = max(pool, key=lambda c: (total(c, "tokens_saved"), -total(c, "valid_stopped")))
    return tuple(json.loads(pick.replace("(", "[").replace(")", "]")))


def scan_table(scanned: dict, pick=None) -> list[str]:
    rows = []
    for c, per in scanned.items():
        r = {"cand": c + (" <- chosen" if pick and c == str(tuple(pick)) else "")}
        for t, s in per.items():
            r[f"{t}_stop"] = f"{s['failed_stopped']}/{s['failed']}"
            r[f"{t}_at"] = s["mean_stop"]
            r[f"{t}_wrong"] = f"{s['valid_stopped']}/{s['valid']} ({s['correct_stopped']} correct)"
            r[f"{t}_saved"] = f"{100 * s['tokens_saved'] / max(1, s['tokens_all']):.0f}%"
        rows.append(r)
    tasks = list(next(iter(scanned.values())))
    cols = [("cand", "(max_pattern, min_pattern, min_count)")]
    for t in tasks:
        cols += [(f"{t}_stop", f"{t}: failed rows stopped"), (f"{t}_at", f"{t}: mean stop token"),
                 (f"{t}_wrong", f"{t}: valid rows stopped"), (f"{t}_saved", f"{t}: tokens saved")]
    return ["## loop guard candidates, offline on the bare outputs", table(rows, cols)]


def scan_cmd(args, out: Path):
    with gzip.open(args.files[0], "rt") as f:
        outputs = json.load(f)
    scanned = scan(outputs, args.workers)
    pick = choose(scanned)
    dump(out / "scan.json", {"scan": scanned, "chosen": pick})
    return {}, scan_table(scanned, pick)


# ---------------------------------------------------------------- guard + recipes

def guard(args, out: Path):
    src = WORK / "bare-outputs.json.gz"
    with gzip.open(src, "rt") as f:
        outputs = json.load(f)
    t = time.monotonic()
    scanned = scan(outputs, args.workers)
    pick = tuple(args.pick) if args.pick else choose(scanned)
    res = {"scan": scanned, "chosen": pick, "scan_s": round(time.monotonic() - t, 1)}
    dump(out / "guard.json", res)
    lines = scan_table(scanned, pick)
    sc = {"label": f"guard {pick} + recipes", "model": args.model, "rows": args.rows, "max_tokens": args.max_tokens,
          "tasks": args.tasks, "pick": pick, "cap": args.cap, "recipes": args.recipes, "bounded": args.bounded,
          "soft_limit": args.timeout - 20}
    r = spawn("online", sc, args.timeout, out)
    res["online"] = r
    dump(out / "guard.json", res)
    return res, lines + online_tables(r)


def online_tables(r: dict) -> list[str]:
    if "tasks" not in r:
        return [f"online run failed: {r.get('error')}"]
    rows = [{"task": t, **{k: v for k, v in s.items() if not isinstance(v, (list, dict))}} for t, s in r["tasks"].items()]
    cols = [("task", "task"), ("rows", "rows"), ("repetition", "stopped by the guard"), ("length", "cut at max_tokens"),
            ("tokens", "out tokens"), ("bare_tokens", "out tokens without guard"), ("valid", "valid"),
            ("bare_valid", "valid without guard"), ("valid_lost", "valid rows lost"), ("correct", "correct"),
            ("bare_correct", "correct without guard"), ("generate_s", "generate s"), ("bare_generate_s", "generate s without guard")]
    rec = [x for x in r.get("recipes", [])]
    rcols = [("recipe", "recipe"), ("task", "task"), ("rows", "failed rows in"), ("valid", "rescued valid"),
             ("correct", "rescued correct"), ("tokens", "out tokens"), ("seconds", "GPU s"),
             ("valid_per_s", "valid/GPU-s"), ("correct_per_s", "correct/GPU-s"), ("repetition", "candidates stopped by guard"),
             ("length", "candidates cut at max_tokens")]
    return [f"## pass 1 online with the guard {r.get('pick')} (engine start {r.get('llm_init_s')} s)", table(rows, cols),
            "## fallback recipes on the rows that failed pass 1 (same engine)", table(rec, rcols)]


# ---------------------------------------------------------------- workers

def _env():
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def _engine_kwargs(model: str) -> dict:
    """What VllmEngine passes for a job that sets only model.path (kept in step by hand; compared in the log)."""
    from vllm.platforms import current_platform

    kw = dict(model=model, dtype="auto", disable_log_stats=False,
              structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
    if current_platform.is_cpu():
        kw["enforce_eager"] = True
    return kw


def _frame(llm, system: str) -> tuple[str, str]:
    from batchjson.prompts import MARK

    text = llm.get_tokenizer().apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": MARK}],
                                                   tokenize=False, add_generation_prompt=True)
    prefix, _, suffix = text.partition(MARK)
    return prefix, suffix


def _prompts(task: str, rows: int, frame) -> tuple[list[str], list[str], list[str]]:
    from tasks import rows as task_rows

    data = task_rows(task, rows)
    t = TASKS[task]
    return ([r[0] for r in data], [frame[0] + t["template"].format(text=r[1]) + frame[1] for r in data],
            [r[2] for r in data])


def _check(task: str, validator, text: str, finish: str, truth: str) -> tuple[bool, bool, float, str | None]:
    from batchjson.records import Generation, Prompt

    o = validator.check(Generation(Prompt("x", "u", ""), text, finish, 0, 0))
    exact, fields = score(task, o.value, truth) if o.ok else (False, 0.0)
    return o.ok, exact, fields, o.reason


def w_bare(sc: dict) -> dict:
    t_launch, t0 = sc["t_launch"], time.time()
    _env()
    stamp = lambda: round(time.time() - t_launch, 3)  # noqa: E731
    res = {"task": sc["task"], "interpreter_s": round(t0 - t_launch, 3)}
    a = time.time()
    import vllm  # noqa: F401

    res["import_vllm_s"] = round(time.time() - a, 3)
    a = time.time()
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    res["from_vllm_import_LLM_s"] = round(time.time() - a, 3)
    from batchjson.schema.validate import Validator

    a = time.time()
    llm = LLM(**_engine_kwargs(sc["model"]))
    res["llm_init_s"] = round(time.time() - a, 2)
    task = sc["task"]
    ids, prompts, truths = _prompts(task, sc["rows"], _frame(llm, TASKS[task]["system"]))
    params = SamplingParams(temperature=0.0, max_tokens=sc["max_tokens"],
                            structured_outputs=StructuredOutputsParams(json=schema(task, sc.get("bounded", False))))
    res["to_first_request_s"] = stamp()
    a = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    res["generate_s"] = round(time.time() - a, 2)
    res["whole_s"] = stamp()
    validator = Validator(schema(task, sc.get("bounded", False)))
    reasons: dict[str, int] = {}
    out_rows, valid = [], 0
    correct, field_sum = 0, 0.0
    for i, o, truth in zip(ids, outs, truths):
        c = o.outputs[0]
        ok, exact, fields, reason = _check(task, validator, c.text, c.finish_reason or "", truth)
        valid += ok
        correct += exact
        field_sum += fields
        reasons[reason or "ok"] = reasons.get(reason or "ok", 0) + 1
        out_rows.append({"id": i, "ids": list(c.token_ids), "finish": c.finish_reason, "text": c.text, "valid": ok,
                         "correct": exact})
    res |= {"rows": len(out_rows), "valid": valid, "correct": correct, "field_acc": round(field_sum / len(out_rows), 3),
            "reasons": reasons, "length_capped": sum(r["finish"] == "length" for r in out_rows),
            "output_tokens": sum(len(r["ids"]) for r in out_rows),
            "max_num_seqs": getattr(getattr(getattr(llm.llm_engine, "vllm_config", None), "scheduler_config", None),
                                    "max_num_seqs", None)}
    if sc.get("keep_outputs"):
        res["outputs"] = out_rows
    llm.llm_engine.engine_core.shutdown()
    return res


class Stamps:
    """Wraps functions and methods to record when each call starts and ends (seconds since the launch)."""

    def __init__(self, t_launch: float):
        self.t, self.events = t_launch, []

    def wrap(self, owner, name: str, label: str | None = None, first_only: bool = False):
        inner = getattr(owner, name)
        label = label or name
        events, t = self.events, self.t

        def wrapper(*args, **kwargs):
            start = time.time() - t
            try:
                return inner(*args, **kwargs)
            finally:
                if not first_only or not any(e[0] == label for e in events):
                    events.append((label, round(start, 3), round(time.time() - t, 3)))

        setattr(owner, name, wrapper)


def w_batchjson(sc: dict) -> dict:
    t_launch, t0 = sc["t_launch"], time.time()
    _env()
    s = Stamps(t_launch)
    s.events.append(("python start", 0.0, round(t0 - t_launch, 3)))
    a = time.time() - t_launch

    import pyarrow.parquet as pq

    import batchjson.api as api
    import batchjson.cli as cli
    import batchjson.engine.vllm_engine as engine
    import batchjson.job as run
    import batchjson.source as source
    import batchjson.spec as spec
    import batchjson.storage as storage
    import batchjson.schema.validate as validate

    s.events.append(("import batchjson (cli, run)", round(a, 3), round(time.time() - t_launch, 3)))
    data, job = write_task(sc["task"], sc["rows"], WORK / "jobs", sc["model"], max_tokens=sc["max_tokens"],
                           extra=sc.get("extra") or "", bounded=sc.get("bounded", False))
    out_dir = WORK / f"out-{sc['task']}"
    s.wrap(api, "load_spec", "load_spec (TOML, schema check)")
    s.wrap(source.ParquetSource, "check", "source.check (footers)")
    s.wrap(source.ParquetSource, "scan", "source.scan (id column, fingerprints)")
    s.wrap(source, "list_files", "list_files")
    s.wrap(pq.ParquetFile, "__init__", "pq.ParquetFile() (a footer read)")
    s.wrap(storage.Storage, "open", "storage.open")
    s.wrap(storage.Storage, "check_inputs", "storage.check_inputs")
    s.wrap(spec.JobSpec, "hash", "spec.hash")
    s.wrap(validate.Validator, "__init__", "Validator() (schema compile)")
    s.wrap(engine, "resolve_model", "resolve_model")
    s.wrap(engine.VllmEngine, "__init__", "VllmEngine() (all of it)")
    s.wrap(engine.VllmEngine, "_probe", "engine probe (a '{' request)")
    s.wrap(run, "chat_frame", "chat template (prompts.chat_frame, from the tokenizer)")
    s.wrap(engine.VllmEngine, "close", "engine close")
    run_pass = run.JobRun._run_pass

    def timed_pass(self, report, p):
        a = time.time() - t_launch
        try:
            return run_pass(self, report, p)
        finally:
            s.events.append((f"pass {p.number}", round(a, 3), round(time.time() - t_launch, 3)))

    run.JobRun._run_pass = timed_pass
    s.wrap(run, "verify", "verify (exactly-once check)")
    real_vllm = engine._vllm

    def vllm_import():
        a = time.time() - t_launch
        import vllm  # noqa: F401

        s.events.append(("import vllm", round(a, 3), round(time.time() - t_launch, 3)))
        mod = real_vllm()
        s.events.append(("engine._vllm (import vllm, from vllm import LLM, checks)", round(a, 3),
                         round(time.time() - t_launch, 3)))
        if not getattr(mod.LLM, "_gs_wrapped", False):
            s.wrap(mod.LLM, "__init__", "vllm.LLM() (engine start)")
            s.wrap(mod.LLM, "enqueue", "LLM.enqueue")
            mod.LLM._gs_wrapped = True
        return mod

    engine._vllm = vllm_import
    a = time.time()
    code = 0
    try:
        if True:  # the CLI prints the report; the run also writes it to <output>/_report.json
            cli.main(["run", str(job), "--output", str(out_dir), "--fresh", "--json-report"], standalone_mode=False)
    except SystemExit as e:
        code = e.code
    whole = round(time.time() - t_launch, 3)
    report = json.loads((out_dir / "_report.json").read_text())
    # Score the valid rows against the truth.
    truth = dict(zip(*(pq.read_table(data, columns=["id", "truth"]).to_pydict()[c] for c in ("id", "truth"))))
    correct = 0
    for part in sorted(out_dir.glob("p*.parquet")):
        t = pq.read_table(part, columns=["id", "json"]).to_pydict()
        correct += sum(score(sc["task"], json.loads(j), truth[i])[0] for i, j in zip(t["id"], t["json"]))
    ev = s.events
    enq = [e for e in ev if e[0] == "LLM.enqueue"]
    inits = [e for e in ev if e[0] == "vllm.LLM() (engine start)"]
    probes = [e for e in ev if e[0].startswith("engine probe")]
    # The first request of a pass is the first enqueue after that pass's probe.
    first_req = next((e[1] for e in enq if probes and e[1] > probes[0][2]), None)
    passes = {e[0]: e for e in ev if e[0] in ("pass 1", "pass 2")}
    startup = {}
    for e in ev:
        if first_req is not None and e[1] <= first_req and e[0] not in ("LLM.enqueue", "pass 1"):
            startup[e[0]] = round(startup.get(e[0], 0) + e[2] - e[1], 3)
    startup["pq.ParquetFile() count before the 1st request"] = sum(
        1 for e in ev if e[0].startswith("pq.ParquetFile") and first_req is not None and e[1] < first_req)
    return {"task": sc["task"], "exit_code": code, "report": report, "valid": report.get("valid"), "correct": correct,
            "whole_s": whole, "to_first_request_s": first_req, "events": ev, "startup": startup,
            "pass1_s": round(passes["pass 1"][2] - passes["pass 1"][1], 2) if "pass 1" in passes else None,
            "pass2_s": round(passes["pass 2"][2] - passes["pass 2"][1], 2) if "pass 2" in passes else None,
            "pass1_engine_start_s": round(inits[0][2] - inits[0][1], 2) if inits else None,
            "pass2_engine_start_s": round(inits[1][2] - inits[1][1], 2) if len(inits) > 1 else None}


def w_online(sc: dict) -> dict:
    """One engine: pass 1 greedy with the chosen guard per task (against the bare outputs without it), then each
    fallback recipe on the rows that failed pass 1, task by task."""
    t_launch = sc["t_launch"]
    _env()
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RepetitionDetectionParams, StructuredOutputsParams

    from batchjson.schema.validate import Validator

    with gzip.open(WORK / "bare-outputs.json.gz", "rt") as f:
        bare = json.load(f)
    bare_runs = {}
    before_json = Path(sc.get("before_json") or WORK / "before.json")
    if before_json.exists():
        bare_runs = {r["task"]: r for r in json.loads(before_json.read_text())["runs"] if "generate_s" in r and "cold" not in r}
    a = time.time()
    llm = LLM(**_engine_kwargs(sc["model"]))
    res = {"pick": sc["pick"], "llm_init_s": round(time.time() - a, 2), "tasks": {}, "recipes": []}
    guard = dict(zip(("max_pattern_size", "min_pattern_size", "min_count"), sc["pick"]))
    failed = {}
    for task in sc["tasks"]:
        ids, prompts, truths = _prompts(task, sc["rows"], _frame(llm, TASKS[task]["system"]))
        so = StructuredOutputsParams(json=schema(task, sc.get("bounded", False)))
        params = SamplingParams(temperature=0.0, max_tokens=sc["max_tokens"], structured_outputs=so,
                                repetition_detection=RepetitionDetectionParams(**guard))
        a = time.time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sec = time.time() - a
        v = Validator(schema(task, sc.get("bounded", False)))
        b = {r["id"]: r for r in bare.get(task, [])}
        st = {"rows": len(outs), "repetition": 0, "length": 0, "tokens": 0, "bare_tokens": 0, "valid": 0,
              "bare_valid": 0, "valid_lost": 0, "valid_gained": 0, "correct": 0, "bare_correct": 0,
              "generate_s": round(sec, 2), "bare_generate_s": bare_runs.get(task, {}).get("generate_s"),
              "same_text_unstopped": 0, "diff_text_unstopped": 0, "lost_examples": []}
        fails = []
        for i, p, truth, o in zip(ids, prompts, truths, outs):
            c = o.outputs[0]
            ok, exact, _, _ = _check(task, v, c.text, c.finish_reason or "", truth)
            st["repetition"] += c.finish_reason == "repetition"
            st["length"] += c.finish_reason == "length"
            st["tokens"] += len(c.token_ids)
            st["valid"] += ok
            st["correct"] += exact
            old = b.get(i)
            if old:
                st["bare_tokens"] += len(old["ids"])
                st["bare_valid"] += old["valid"]
                st["bare_correct"] += old["correct"]
                if old["valid"] and not ok:
                    st["valid_lost"] += 1
                    if len(st["lost_examples"]) < 3:
                        st["lost_examples"].append(old["text"][:160])
                st["valid_gained"] += ok and not old["valid"]
                if c.finish_reason != "repetition":
                    st["same_text_unstopped" if c.text == old["text"] else "diff_text_unstopped"] += 1
            if not ok:
                fails.append((i, p, truth))
        res["tasks"][task] = st
        failed[task] = fails[: sc["cap"]]
        dump(Path(sc["partial"]), res)
        print(f"[online] {task}: {st}", flush=True)
    for name, change in [r for r in RECIPES if r[0] in sc["recipes"]]:
        recipe = FALLBACK | change
        g = recipe.pop("guard", guard)
        for task in sc["tasks"]:
            rows = failed[task]
            if not rows:
                continue
            v = Validator(schema(task, sc.get("bounded", False)))
            params = SamplingParams(temperature=recipe["temperature"], top_p=recipe["top_p"],
                                    repetition_penalty=recipe["repetition_penalty"], seed=recipe["seed"],
                                    max_tokens=recipe["max_tokens"], n=recipe.get("n", 1),
                                    structured_outputs=StructuredOutputsParams(json=schema(task, sc.get("bounded", False))),
                                    **({"repetition_detection": RepetitionDetectionParams(**g)} if g else {}))
            a = time.time()
            outs = llm.generate([p for _, p, _ in rows], params, use_tqdm=False)
            sec = time.time() - a
            r = {"recipe": name, "task": task, "rows": len(rows), "valid": 0, "correct": 0, "tokens": 0,
                 "repetition": 0, "length": 0, "seconds": round(sec, 2), "which_candidate": {}}
            for (_, _, truth), o in zip(rows, outs):
                pick = None
                for k, c in enumerate(o.outputs):  # keep the first valid candidate, in index order
                    r["tokens"] += len(c.token_ids)
                    r["repetition"] += c.finish_reason == "repetition"
                    r["length"] += c.finish_reason == "length"
                    ok, exact, _, _ = _check(task, v, c.text, c.finish_reason or "", truth)
                    if ok and pick is None:
                        pick = (k, exact)
                if pick:
                    r["valid"] += 1
                    r["correct"] += pick[1]
                    r["which_candidate"][str(pick[0])] = r["which_candidate"].get(str(pick[0]), 0) + 1
            r["valid_per_s"] = round(r["valid"] / sec, 2)
            r["correct_per_s"] = round(r["correct"] / sec, 2)
            res["recipes"].append(r)
            dump(Path(sc["partial"]), res)
            print(f"[recipe] {r}", flush=True)
            if time.time() - t_launch > sc.get("soft_limit", 1e9):
                res["note"] = "stopped early: soft limit"
                break
    llm.llm_engine.engine_core.shutdown()
    return res


WORKERS = {"bare": w_bare, "batchjson": w_batchjson, "online": w_online}


def tables(args, out):
    lines = []
    for f in args.files:
        d = json.loads(Path(f).read_text())
        name = Path(f).stem
        if name.endswith("before"):
            lines += before_table(d["runs"])
        elif name.endswith("batchjson"):
            lines += batchjson_table(d["runs"])
        elif name.endswith("guard"):
            lines += scan_table(d["scan"], d.get("chosen")) + (online_tables(d["online"]) if "online" in d else [])
        elif name.endswith("scan"):
            lines += scan_table(d["scan"], d.get("chosen"))
    return {}, lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)

    def add(name):
        p = sub.add_parser(name)
        p.add_argument("--out", default=str(WORK / "results"))
        p.add_argument("--model", default="/tmp/models/smollm2")
        p.add_argument("--rows", type=int, default=600)
        p.add_argument("--max-tokens", type=int, default=384)
        p.add_argument("--tasks", type=lambda s: s.split(","), default=["A", "B", "C"])
        p.add_argument("--timeout", type=float, default=300, help="seconds per worker")
        p.add_argument("--budget", type=float, default=560, help="seconds for the whole invocation")
        p.add_argument("--tag", default="")
        p.add_argument("--bounded", action="store_true", help="the tasks' schemas with maxItems/maxLength")
        return p

    b = add("before")
    b.add_argument("--cold", action="store_true", help="first a cold-start run of the last task (fills the compile cache)")
    j = add("batchjson")
    j.add_argument("--extra", default="", help="TOML appended to each task's job spec")
    g = add("guard")
    g.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    g.add_argument("--pick", type=int, nargs=3, help="use this guard instead of the scan's choice")
    g.add_argument("--cap", type=int, default=300, help="failed rows per task given to each recipe")
    g.add_argument("--recipes", type=lambda s: s.split(","), default=[r[0] for r in RECIPES])
    s = add("scan")
    s.add_argument("files", nargs=1)
    s.add_argument("--workers", type=int, default=1)
    c = add("cost")
    c.add_argument("files", nargs=1)
    t = add("tables")
    t.add_argument("files", nargs="+")
    w = sub.add_parser("_worker")
    w.add_argument("kind")
    w.add_argument("scenario", type=Path)
    w.add_argument("result", type=Path)
    args = ap.parse_args()
    if args.mode == "_worker":
        import traceback

        sc = json.loads(args.scenario.read_text())
        try:
            dump(args.result, WORKERS[args.kind](sc))
            return 0
        except BaseException as e:
            dump(args.result, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]})
            traceback.print_exc()
            return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    fn = {"before": before, "batchjson": batchjson_runs, "guard": guard, "scan": scan_cmd, "cost": guard_cost, "tables": tables}[args.mode]
    _, lines = fn(args, out)
    print(f"\n# gpu_seconds {args.mode} finished in {time.monotonic() - t0:.0f}s; results in {out}\n", flush=True)
    print("\n\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
