"""Whole runs of a new user's minimal job next to bare vLLM: each run in its own process, all in one call.

    python bench/whole_runs.py --task C --rows 6000 --runs warm-none,warm-suffix,bare-none,bare-suffix,auto,none,suffix \
        --model /tmp/models/smollm2 --out OUT --budget 560

Runs, in the order given (compare only runs of one call: machines differ by +-30% between calls):
  bare-none, bare-suffix, bare-ngram, bare-draft
                          bare vLLM as its documentation shows it: `LLM(model, structured_outputs_config)` and one
                          `llm.generate` over every prompt (the chat frame batchjson renders, the same schema, greedy,
                          the same max_tokens); the others add the speculative_config batchjson's run of that method
                          uses (common.SPECULATIVE: suffix k 8, ngram k 4, draft_model k 4 with --draft, schema k 8).
                          vLLM's defaults otherwise: its own batch size (max_num_seqs), no loop guard. Validated and
                          scored afterwards, outside the clock. bare-<method>@N: max_num_seqs = N.
  bare-schema             bare vLLM with batchjson's schema drafter as its custom_class proposer (k 8).
  auto, none, suffix, ngram, draft, schema  `batchjson run` of the minimal job (bench/tasks.py: input, template, schema,
                          model, max_tokens, output); "auto" has no [speculative] table (the default), the others set
                          [speculative] method (draft: method "draft_model", draft_model = --draft).
  autodraft               the default with [speculative] draft_model = --draft (auto judges the draft model).
  <run>@N                 the same with [model.engine] max_num_seqs = N: N requests decode at once, as in bare-<method>@N
                          (batchjson keeps 2N in the engine; before 2026-12 @N set [model] max_in_flight = N instead).
  <run>-noguard           the same with the loop guard off in both passes (repetition_detection = false).
  <run>-noadapt           the same with [sampling] adapt = false (pass 1 keeps its own settings however its rows do).
  <run>-nofills           the same with [model] grammar_fills = "vllm" (vLLM's own mask fills, not batchjson's).
  <run>+av                the same with Model Runner V2's adaptive verification (vLLM 0.34; [speculative.options]
                          enable_adaptive_verification = true): a step verifies the drafts its profiled cost and the
                          drafter's confidences say pay (suffix, schema, draft_model).
  <run>+ahead             the same with the grammars' work beside the forward's launch (BATCHJSON_GRAMMAR_AHEAD=1;
                          engine/vllm/ahead.py GrammarAhead; the default since 2026-12-06, with drafts too).
  <run>+noahead           the same with the grammars' work when vLLM asks for it (BATCHJSON_GRAMMAR_AHEAD=0).
  <run>+p2                pass 1 stops every row at 8 tokens, so pass 2 (max_tokens as given, no drafts) decodes all
                          rows on pass 1's engine: draft+p2 against none+p2 is what the drafter costs requests
                          without drafts (draft+p2-noadapt: not with -noguard).
  <run>+trace             the same under bench/start_trace.py (its main thread's stack sampled: where the time
                          before the engine decodes goes): auto+trace, none+rpg2+trace.
  <run>+rpgN              the same with [model] replicas_per_gpu = N (N engine replicas share each GPU); last in
                          the name (none@512+rpg2, none+p2+rpg2). --replicas-per-gpu 1,2,3,4 runs each batchjson run of --runs so.
  <run>+cgN               the same with CUDA graphs captured for steps of up to N tokens ([model.engine]
                          compilation_config; engine/vllm_engine.py graph_sizes; batchjson's GPU default is 2,048, so
                          +cg512 is vLLM's own list); bare vLLM keeps its own (up to 512).
  <run>+gmuX              the same with [model.engine] gpu_memory_utilization = X (each engine's share of its GPU):
                          none+gmu0.3+rpg1 against none+rpg1 is what a lone engine's KV cache size costs its start.
  <run>+measure           the same with batchjson's cache emptied first, as on a configuration's first night: the
                          first replica of a GPU measures its KV cache alone, the others start after it
                          (none+rpg2+measure against none+rpg2: what a size kept from an earlier start saves
                          replicas that share a GPU; engine/kv_sizes.py).
  <run>+stats             the same with vLLM's stats on ([model.engine] disable_log_stats = false), as batchjson ran
                          every engine before 2026-12 (now only speculative ones, whose draft counters it reads).
  <run>+log               the same with vLLM's INFO log kept in OUT/<run>.log (its engine start's parts: weights,
                          torch.compile, CUDA graphs).
  <run>+prof              the same with the step profiler (BATCHJSON_PROFILE_STEPS, no GPU waits): the engine's steps,
                          ms per step and the step's parts over the whole run (probe and warm-up steps included).
  <run>+spy, bare-<m>+spy the same under py-spy (every process of the run, 50 samples/s, --nonblocking, where py-spy is
                          installed): per process, its share of samples in the top functions (OUT/spy-<run>.txt.gz
                          keeps the raw stacks).
  <run>+gpusN             the same on only the first N of the GPUs the call sees (CUDA_VISIBLE_DEVICES): none+gpus1,
                          none+gpus2, none+rpg1+gpus4 against each other on a multi-GPU host.
  before:<run>            the same job run by an earlier batchjson tree (--before DIR, its package folder's parent).
  <run>+warm              the same batchjson run on 64 rows, not in the table: it fills the compile cache for
                          batchjson's own engine configuration (none+rpg3+warm before none+rpg3 and its variants).
  warm-none, warm-suffix  a bare run on 64 rows that fills the compile cache for that engine configuration (a first
                          start on a machine compiles for ~20 s more); not in the table.

Wall seconds count from the run's process launch to its exit. `first_request_s` is the time to the engine's first
request: bare vLLM's after `import vllm` + `LLM()` + rendering, batchjson's from the report (from batchjson's import).
Each run also gets its rows/s and output tok/s over the wall, and what a sampler saw every second meanwhile: GPU
utilisation and memory in use (nvidia-smi, where there is one) and the host's CPU busy fraction (/proc/stat).
Results go to OUT/whole-<task>-<rows>.json after each run, so a call cut short keeps what finished; the call exits 1
when a run failed.

Replicas per GPU (BENCHMARKS.md, "Replicas per GPU"), one model, each run its own call (a run of 30,000 rows takes
minutes):
    for n in 1 2 3 4; do python3 -m bench whole-runs --task C --rows 30000 --runs none+rpg$n --timeout 580 \
        --budget 590 --model /tmp/models/smollm2 --out OUT/rpg-smollm2-$n; done
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from batchjson.engine.devices import visible_gpus
from batchjson.engine.vllm.ahead import AHEAD_ENV
from batchjson.engine.vllm_engine import graph_sizes
from bench.common import P1, P2, ROOT, SPECULATIVE, cli, run_group, speculative
from bench.replicas import HostSampler
from bench.tasks import TASKS, schema, score, write_task

# ---------------------------------------------------------------- bare vLLM, in its own process

def bare(task: str, rows: int, model: str, max_tokens: int, method: str, seqs: int | None, draft: str | None,
         t_launch: float) -> dict:
    from bench.common import check as _check, frame as _frame, task_prompts as _prompts

    stamp = lambda: round(time.time() - t_launch, 2)  # noqa: E731
    import vllm
    from vllm.platforms import current_platform
    from vllm.sampling_params import StructuredOutputsParams

    from batchjson.schema.validate import Validator

    imported = stamp()
    kwargs = dict(model=model, structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
    if method != "none":
        kwargs["speculative_config"] = speculative(method, schema(task)) | ({"model": draft} if method == "draft" else {})
    if seqs:
        kwargs["max_num_seqs"] = seqs
    if current_platform.is_cpu():
        kwargs["enforce_eager"] = True
    llm = vllm.LLM(**kwargs)
    started = stamp()
    _, prompts, truths = _prompts(task, rows, _frame(llm, TASKS[task]["system"]))
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=schema(task)))
    first = stamp()
    outs = llm.generate(prompts, params, use_tqdm=False)
    done = stamp()
    seqs = llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    llm.llm_engine.engine_core.shutdown()
    validator = Validator(schema(task))  # batchjson's: parse, schema, finish reason; then the ground truth
    checked = [_check(task, validator, o.outputs[0].text, o.outputs[0].finish_reason or "", truth)
               for o, truth in zip(outs, truths)]
    return {"import_s": imported, "engine_ready_s": started, "first_request_s": first, "decode_s": round(done - first, 2),
            "done_s": done, "max_num_seqs": seqs, "engine_starts": 1,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "valid": sum(c[0] for c in checked), "correct": sum(c[1] for c in checked),
            "fields": round(sum(c[2] for c in checked) / max(len(checked), 1), 4)}


# ---------------------------------------------------------------- batchjson, by its command line

def warm_up(run: str) -> bool:
    """A run that only fills compile caches (64 rows, not in the table)."""
    return run.startswith("warm-") or "+warm" in run


def batchjson_run(name: str, args, rows: int, work: Path, t_launch: float, timeout: float) -> dict:
    tree, _, run = name.rpartition(":")
    traced = "+trace" in run
    gpus, share = re.search(r"\+gpus(\d+)", run), re.search(r"\+gmu([0-9.]+)", run)
    stats, profiled, spied, logged = "+stats" in run, "+prof" in run, "+spy" in run, "+log" in run
    measured, ahead = "+measure" in run, "1" if "+ahead" in run else "0" if "+noahead" in run else ""
    adaptive = "+av" in run
    graphs = re.search(r"\+cg(\d+)", run)
    flags = r"\+gpus\d+|\+gmu[0-9.]+|\+cg\d+|\+warm|\+trace|\+stats|\+prof|\+spy|\+log|\+measure|\+noahead|\+ahead|\+av"
    run, _, per_gpu = re.sub(flags, "", run).partition("+rpg")
    base, _, size = run.partition("@")
    pass2 = "+p2" in base
    method, *flags = base.replace("+p2", "").split("-no")
    folder = work / name.replace("@", "-at-").replace(":", "-")
    data, job = write_task(args.task, rows, folder, args.model, max_tokens=args.max_tokens)
    text = job.read_text()
    if method == "autodraft":
        text += f'\n[speculative]\ndraft_model = {json.dumps(args.draft)}\n'
    elif method == "draft":
        text += f'\n[speculative]\nmethod = "draft_model"\ndraft_model = {json.dumps(args.draft)}\n'
    elif method != "auto":
        k = SPECULATIVE.get(method, {}).get("num_speculative_tokens", 4)
        text += f'\n[speculative]\nmethod = "{method}"\nnum_speculative_tokens = {k}\n'
    if "fills" in flags:
        text = text.replace("[model]\n", '[model]\ngrammar_fills = "vllm"\n', 1)
    if adaptive:  # Model Runner V2's adaptive verification (vLLM 0.34), off in vLLM and batchjson by default
        text += "\n[speculative.options]\nenable_adaptive_verification = true\n"
    if "adapt" in flags:
        text = text.replace("[sampling]\n", "[sampling]\nadapt = false\n", 1)
    if "guard" in flags:  # write_task writes a [sampling] table and no [fallback] one
        text = text.replace("[sampling]\n", "[sampling]\nrepetition_detection = false\n", 1)
        text += "\n[fallback]\nrepetition_detection = false\n"
    if pass2:  # pass 1 stops every row at 8 tokens: all of them are retried by pass 2, on the same engine
        text = text.replace(f"max_tokens = {args.max_tokens}", "max_tokens = 8", 1)
        text += f"\n[fallback]\nmax_tokens = {args.max_tokens}\ntemperature = 0.0\n"  # greedy: the same tokens in both
    engine = {"max_num_seqs": int(size)} if size else {}  # bare's @N: the same configuration, so the same compile cache
    if share:
        engine["gpu_memory_utilization"] = float(share.group(1))
    if stats:
        engine["disable_log_stats"] = "false"
    if graphs:  # a TOML inline table
        sizes = ", ".join(map(str, graph_sizes(int(graphs.group(1)))))
        engine["compilation_config"] = f"{{cudagraph_capture_sizes = [{sizes}]}}"
    if engine:
        text += "\n[model.engine]\n" + "".join(f"{k} = {v}\n" for k, v in engine.items())
    if per_gpu:
        text = text.replace("[model]\n", f"[model]\nreplicas_per_gpu = {int(per_gpu)}\n", 1)
    job.write_text(text)
    out = folder / "out"
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    if ahead:
        env[AHEAD_ENV] = ahead
    if measured:  # batchjson's own cache empty: no KV cache size kept from an earlier start (engine/kv_sizes.py)
        shutil.rmtree(folder / "cache", ignore_errors=True)
        env["BATCHJSON_CACHE"] = str(folder / "cache")
    if logged:  # vLLM's INFO lines (its engine start's parts: weights, compile, CUDA graphs) kept beside the results
        env["VLLM_LOGGING_LEVEL"] = "INFO"
    if gpus:  # the first N of the GPUs this call sees
        n, seen = int(gpus.group(1)), visible_gpus()
        if len(seen) < n:
            return {"error": f"+gpus{n}: this call sees {len(seen)} GPU(s)"}
        env["CUDA_VISIBLE_DEVICES"] = ",".join(seen[:n])
    if tree:  # the earlier tree first on the path, and not this one's from the working folder
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (args.before, env.get("PYTHONPATH"))))
    command = cli("run", str(job), "--output", str(out), "--fresh")
    profile = folder / "profile.json"
    if profiled:
        from batchjson.engine.profiler import ENV_PROFILE, ENV_PROFILE_SYNC

        env |= {ENV_PROFILE: str(profile), ENV_PROFILE_SYNC: "0"}
    if spied:
        command = spy(command, args.out, name)
    if traced:  # the same run with its main thread's stack sampled (bench/start_trace.py)
        command = [sys.executable, "-m", "bench", "start-trace", str(job), "--output", str(out),
                   "--out", str(folder / "trace.json")]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    proc = run_group(command, timeout, env=env, cwd=folder)
    done = round(time.time() - t_launch, 2)
    if logged:
        (Path(args.out) / f"{name.replace(':', '-')}.log").write_text(proc.stdout + proc.stderr)
    report_file = out / "_report.json"
    if proc.returncode != 0 or not report_file.exists():
        return {"error": f"rc {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"}
    report = json.loads(report_file.read_text())
    p1, p2 = report["passes"][P1], report["passes"].get(P2, {})
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    truth = dict(zip(*pq.read_table(data, columns=["id", "truth"]).to_pydict().values()))
    parts = ds.dataset(str(out), format="parquet")  # the output's parts (pyarrow skips _rejects, _batchjson)
    got = parts.to_table(columns=["id", "json"]).to_pydict() if parts.files else {"id": [], "json": []}
    scores = [score(args.task, json.loads(j), json.loads(truth[i])) for i, j in zip(got["id"], got["json"])]
    correct, fields = sum(s[0] for s in scores), round(sum(s[1] for s in scores) / max(len(truth), 1), 4)
    auto, recipe = (p1.get("auto") or [{}])[0], (p1.get("recipe") or [{}])[0]
    return {"first_request_s": p1.get("first_request_s"), "done_s": done, "run_s": report["seconds"],
            "engine_starts": report.get("engine_starts"), "engine_start_s": report.get("engine_start_s"),
            "engine_steps": report.get("engine_steps"), "ms_per_step": report.get("ms_per_step"),
            "pass1_valid": p1["valid"], "recipe": recipe.get("recipe", ""), "recipe_why": recipe.get("why", ""),
            "pass1_s": p1["seconds"], "pass2_s": p2.get("seconds"), "pass2_rows": p2.get("rows", 0), "pass2_valid": p2.get("valid", 0),
            "output_tokens": p1["output_tokens"] + p2.get("output_tokens", 0),
            "valid": report["valid"], "correct": correct, "fields": fields, "rejected": report["rejected"],
            "acceptance": p1.get("acceptance"), "pass1_output_tokens_per_s": p1.get("output_tokens_per_s"),
            "replicas": report.get("replicas"), "replicas_per_gpu": report.get("replicas_per_gpu"),
            "layout": report.get("layout", ""), "timeline": report.get("timeline"),
            "engine_close_s": round(p1.get("engine_close_s", 0) + p2.get("engine_close_s", 0), 2),
            "chosen": auto.get("chosen", method), "why": auto.get("why", ""), "summary": proc.stdout[-2500:],
            "kv_kept": any(e.get("code") == "kv-size-kept" for e in p1.get("events", [])),
            **({"profile": profile_summary(profile)} if profiled else {}),
            **({"spy": spy_summary(args.out, name)} if spied else {}),
            **({"trace": json.loads((folder / "trace.json").read_text())["segments"]} if traced else {})}


def profile_summary(path: Path) -> dict:
    """The step profile of a whole run: steps, ms per step of the engine step, each part's ms per step, and the
    requests, tokens and drafted tokens a step scheduled on average (how full the engine's batch was)."""
    from batchjson.engine.profiler import SCHEDULED, read_profile

    if not path.exists():
        return {"error": "no profile written"}
    prof = read_profile(path)
    steps = max(prof["steps"], 1)
    parts = {k: round(1000 * v["seconds"] / steps, 2) for k, v in sorted(prof["parts"].items())}
    return {"steps": prof["steps"], "ms_per_step": parts.get("engine_step"), "parts_ms_per_step": parts,
            **{f"{k}_per_step": round(prof.get(k, 0) / steps, 1) for k in SCHEDULED}}


def spy(command: list[str], out: str, name: str) -> list[str]:
    """`command` under py-spy (all its processes, 50 samples/s, raw stacks to OUT/spy-<name>.txt), where installed."""
    exe = shutil.which("py-spy")
    if not exe:
        return command
    raw = Path(out) / f"spy-{name}.txt"
    return [exe, "record", "--subprocesses", "--nonblocking", "-r", "50", "-f", "raw", "-o", str(raw), "--", *command]


def spy_summary(out: str, name: str, top: int = 30) -> dict:
    """Per process of a py-spy'd run (its innermost "process" frame names it: a child's stacks begin with its
    parent's): samples, and the share of them under each of the `top` functions that most samples pass through; the
    raw file is gzipped beside the results."""
    import collections
    import gzip

    raw = Path(out) / f"spy-{name}.txt"
    if not raw.exists():
        return {"error": "py-spy is not installed or wrote nothing"}
    procs: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        proc, n = [f for f in frames if f.startswith("process ")][-1][:60], int(count)
        totals[proc] += n
        for f in set(x.split(" (")[0] for x in frames if not x.startswith("process ")):
            procs[proc][f] += n
    raw.with_suffix(".txt.gz").write_bytes(gzip.compress(raw.read_bytes()))
    raw.unlink()
    return {proc: {"samples": totals[proc], "under": [(f, round(c / totals[proc], 3))
                                                       for f, c in procs[proc].most_common(top)]}
            for proc in sorted(totals, key=totals.get, reverse=True)[:4]}


# ---------------------------------------------------------------- the call

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="C")
    ap.add_argument("--rows", type=int, default=6000)
    ap.add_argument("--runs", default="warm-none,warm-suffix,bare-none,bare-suffix,auto,none,suffix")
    ap.add_argument("--model", default="/tmp/models/smollm2")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--timeout", type=float, default=240, help="seconds per run")
    ap.add_argument("--budget", type=float, default=560, help="seconds for the whole call; later runs are skipped")
    ap.add_argument("--out", default="whole-runs")
    ap.add_argument("--work", default="/tmp/whole-runs")
    ap.add_argument("--draft", help="the draft model folder for draft, autodraft and bare-draft runs")
    ap.add_argument("--before", help="an earlier batchjson tree (the folder holding its batchjson/), for before:<run>")
    ap.add_argument("--replicas-per-gpu", help="e.g. 1,2,3,4: each batchjson run of --runs once per count (+rpgN)")
    ap.add_argument("--_bare", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._bare:  # the child side of a bare run
        sc = json.loads(args._bare)
        print("RESULT " + json.dumps(bare(args.task, sc["rows"], args.model, args.max_tokens, sc["method"],
                                          sc["seqs"], args.draft, sc["t_launch"])), flush=True)
        return 0
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    began, results = time.time(), []
    result_file = out / f"whole-{args.task}-{args.rows}.json"
    runs = []
    for name in args.runs.split(","):
        if args.replicas_per_gpu and not name.startswith(("bare-", "warm-")):
            runs += [f"{name}+rpg{n}" for n in args.replicas_per_gpu.split(",")]
        else:
            runs.append(name)
    for name in runs:
        left = args.budget - (time.time() - began)
        if left < 30:
            results.append({"run": name, "error": "skipped: the call's budget is spent"})
            continue
        timeout = min(args.timeout, left)
        t_launch = time.time()
        rows = 64 if warm_up(name) else args.rows
        print(f"[whole] {name}: start ({timeout:.0f} s at most)", flush=True)
        sampler = HostSampler()
        sampler.start()
        try:
            if name.startswith(("bare-", "warm-")):
                kind, _, seqs = name.removesuffix("+spy").split("-", 1)[1].partition("@")
                sc = json.dumps({"rows": rows, "method": kind, "seqs": int(seqs) if seqs else None,
                                 "t_launch": t_launch})
                command = [sys.executable, __file__, "--task", args.task, "--model", args.model,
                           "--max-tokens", str(args.max_tokens), "--_bare", sc] + (["--draft", args.draft] if args.draft else [])
                proc = run_group(spy(command, args.out, name) if name.endswith("+spy") else command, timeout)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                r = json.loads(line[7:]) if line else {"error": f"rc {proc.returncode}: {proc.stderr[-1500:]}"}
                if name.endswith("+spy"):
                    r["spy"] = spy_summary(args.out, name)
            else:
                r = batchjson_run(name, args, rows, work, t_launch, timeout)
        except subprocess.TimeoutExpired:
            r = {"error": f"timed out after {timeout:.0f} s"}
        r = {"run": name, "rows": rows, "wall_s": round(time.time() - t_launch, 1)} | r | sampler.summary()
        if "valid" in r:
            r["valid_per_s"] = round(r["valid"] / r["wall_s"], 1)
            r["rows_per_s"] = round(rows / r["wall_s"], 1)
            r["output_tokens_per_s"] = round(r["output_tokens"] / r["wall_s"], 1)
        results.append(r)
        print(f"[whole] {name}: {json.dumps({k: v for k, v in r.items() if k not in ('summary', 'samples')})}",
              flush=True)
        result_file.write_text(json.dumps({"task": args.task, "rows": args.rows, "max_tokens": args.max_tokens,
                                           "runs": results}, indent=1))
    print("\n| run | wall s | first request s | engine starts | valid | correct | fields | valid/s | rows/s | output tok/s "
          "| GPU util % mean (max) | host CPU busy mean | chosen |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        if warm_up(r["run"]):
            continue
        print(f"| {r['run']} | {r.get('wall_s')} | {r.get('first_request_s')} | {r.get('engine_starts')} | "
              f"{r.get('valid')} | {r.get('correct')} | {r.get('fields')} | {r.get('valid_per_s')} | {r.get('rows_per_s')} | "
              f"{r.get('output_tokens_per_s')} | {r.get('gpu_util_mean')} ({r.get('gpu_util_max')}) | "
              f"{r.get('cpu_busy_mean')} | {r.get('chosen', '')} {r.get('error', '')[:120]} |")
    failed = [r["run"] for r in results if "error" in r and not r["error"].startswith("skipped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
