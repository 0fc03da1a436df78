"""What the JSON constraint costs a step at a full batch: bare vLLM's one `generate`, with no grammar, with vLLM's own
mask fills and with batchjson's (engine/vllm/fills.py, BatchFills), each in its own process, all in one call.

    python -m bench grammar --model /tmp/models/coder-1.5b --task C --rows 6000 --seqs 1024 \
        --configs vllm,batch,free,vllm-ngram,batch-ngram --out OUT

Configurations, run in the order given, for each --seqs (vLLM's max_num_seqs, its batch):
  vllm, batch   the task's JSON Schema (xgrammar, no whitespace, greedy, --max-tokens), the masks filled by vLLM
                (grammar_fills = "vllm") or by batchjson's batch fills when vLLM asks for them ("batch",
                engine/vllm/fills.py BatchFills).
  ahead         the batch fills and the grammars' advance on a thread beside the forward's launch, where vLLM
                schedules ahead without drafts, and with drafts the step's fills beside its launch (engine/vllm/ahead.py
                GrammarAhead, BATCHJSON_GRAMMAR_AHEAD=1); "batch" and "vllm" run with it off (=0).
  late          "ahead" with the grammars' advance when update_from_output asks for it, on the engine core's
                thread, and only the next step's fill beside it (BATCHJSON_GRAMMAR_AHEAD_FROM=update).
  <cfg>@N       the same with N fill threads (BATCHJSON_FILL_THREADS; default vLLM's own count, min(cores/2, 8)).
                "batch" gives xgrammar the grammar schema batchjson's engine gives it (schema/grammar.py: without
                minLength); batch+written the schema as written, as "vllm" does (token-exactness of the fills).
                batchjson's vLLM plugin is loaded into the engine process for the step profiler and the fills.
  free          no grammar, with the same output lengths: ignore_eos, and each row's max_tokens the length of its
                answer in the first schema configuration of the same --seqs and method (run it first), so that
                requests end at the same steps (a batch's churn is part of a step's cost); --max-tokens without one.
  free+mean     the same with every row's max_tokens the mean of those lengths (before 2026-12-06: run26 and
                earlier).
  <cfg>-ngram, <cfg>-suffix, <cfg>-schema   the same with speculation (ngram k 4, suffix k 8, batchjson's schema
                drafter k 8, as whole-runs configures them).
  <cfg>-draft   the same with the draft model of --draft (draft_model, k 4).
  <cfg>+kN      the same with N drafts a request (num_speculative_tokens).
  <cfg>+av      the same with Model Runner V2's adaptive verification (vLLM 0.34; enable_adaptive_verification): a
                step verifies the drafts its profiled cost and the drafter's confidences say pay, not k a request
                (suffix, schema, draft).
  <cfg>+stats   the same with vLLM's stats on (disable_log_stats = False, as batchjson's engine has them).
  <cfg>+gcN     the same with Python's first-generation collection threshold N in the engine core
                (BATCHJSON_ENGINE_GC; batchjson's GPU default 10,000, the interpreter's own 700: +gc700). Without it
                an engine core with GrammarAhead ("ahead", "late") runs batchjson's default; the others keep the
                interpreter's.
  <cfg>+cgN     the same with CUDA graphs captured for steps of up to N tokens (engine/vllm_engine.py graph_sizes;
                vLLM 0.26 captures up to 512, fewer tokens than a step at its full batch).
Each reports generate seconds, engine steps, ms per step, the profile's parts per step (the engine core's
schedule, update_from_output and the grammars' advance inside it, grammar_bitmask, forward launch, sampling launch;
BATCHJSON_PROFILE_SYNC=0, so the GPU overlaps as in a plain run), GPU busy (nvidia-smi), valid and correct rows,
and a digest of each row's tokens:
`differ` counts the rows whose tokens differ from the first configuration of the same kind (schema or free),
--seqs, drafts or not (exactness: schema drafts against none). --pyspy S samples the engine process's stacks for S
seconds during generate (py-spy, where installed; --idle keeps waiting threads' samples, --native native frames),
and the result gives the share of samples in grammar work, each thread's top leaves and those under the forward's
launch. Results: OUT/grammar-<task>-<rows>.json.

    python -m bench grammar --masks --seqs 1024 --drafts 0,4,8 --out OUT

masks the logits of a step with drafts, no engine (where vLLM decodes with its V1 model runner: 0.26 with any
speculation): vLLM's apply_grammar_bitmask against batchjson's (engine/vllm/masks.py, mask_rows and apply_mask_rows),
CPU ms per call and ms until the GPU is done, on this machine's GPU (its CPU without one), the masked logits compared.

`--matchers TOKENIZER` (xgrammar alone, no engine) also times the grammar's advance as update_from_output makes it:
vLLM's own call per request on vLLM's grammar objects (`advance_vllm`) against one batch call, at best and as a patch
would install it (`advance_batch`, `advance_lean`, `advance_patched`; see `advance`).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

from batchjson.engine.vllm_engine import graph_sizes
from bench.common import answer_one, dump, one_process, speculative, table

PARTS = ("schedule", "update_from_output", "advance", "grammar_bitmask", "get_grammar_bitmask", "ahead",
         "ahead_advance", "ahead_fill", "forward", "sample_tokens", "propose", "drafts", "gc", "engine_step")
# propose: a runner-side drafter; drafts: the scheduler's (schema); advance: the grammars' advance by vLLM's call per
# request (most of it in update_from_output); ahead_advance, ahead_fill: GrammarAhead's, where it advances and fills
GRAMMAR_FRAMES = ("grammar_bitmask", "accept_tokens", "fill_next_token_bitmask", "batch_fill", "apply_grammar_bitmask",
                  "batch_accept", "validate_tokens", "rollback")  # py-spy frames counted as the grammar's work


def parse(name: str) -> dict:
    """A configuration's name read: fills (vllm, batch, ahead, late, free), method, threads and its +flags."""
    flags: dict = {flag: f"+{flag}" in name for flag in ("written", "stats", "mean", "av")}
    for flag in flags:
        name = name.replace(f"+{flag}", "")
    graphs = re.search(r"\+cg(\d+)", name)
    flags["graphs"] = int(graphs.group(1)) if graphs else 0
    name = re.sub(r"\+cg\d+", "", name)
    collector = re.search(r"\+gc(\d+)", name)
    flags["gc"] = int(collector.group(1)) if collector else 0
    name = re.sub(r"\+gc\d+", "", name)
    drafts = re.search(r"\+k(\d+)", name)
    flags["k"] = int(drafts.group(1)) if drafts else 0
    name = re.sub(r"\+k\d+", "", name)
    name, _, threads = name.partition("@")
    fills, _, method = name.partition("-")
    return {"fills": fills, "method": method, "threads": threads, **flags}


def one(cfg: dict) -> dict:
    """One configuration in this process: bare vLLM's LLM and one generate."""
    from batchjson.engine.vllm import ahead as wing_ahead, fills as wing_fills
    from batchjson.engine.profiler import DUMP_EVERY_S, ENV_PROFILE, ENV_PROFILE_SYNC, SCHEDULED, read_profile

    profile = Path(cfg["profile"])
    read = parse(cfg["name"])
    fills, method, threads, stats = read["fills"], read["method"], read["threads"], read["stats"]
    ours = fills in ("batch", "ahead", "late")
    os.environ.update({"BATCHJSON_RUNNER_PID": str(os.getpid()), ENV_PROFILE: str(profile), ENV_PROFILE_SYNC: "0",
                       wing_fills.GRAMMAR_FILLS_ENV: "batch" if ours else "vllm",
                       wing_ahead.AHEAD_ENV: "1" if fills in ("ahead", "late") else "0",
                       wing_ahead.AHEAD_FROM_ENV: "update" if fills == "late" else "launch",
                       wing_ahead.ENGINE_GC_ENV: str(read["gc"] or "")})  # "": batchjson's default
    if threads:
        os.environ[wing_fills.FILL_THREADS_ENV] = threads
    from batchjson.engine.vllm_engine import _vllm

    vllm = _vllm()  # imported as batchjson imports it: a CPU build's KV cache size and threads set the same way
    from vllm.platforms import current_platform
    from vllm.sampling_params import StructuredOutputsParams

    from batchjson.schema.validate import Validator
    from bench.common import check, frame, task_prompts
    from bench.replicas import HostSampler
    from bench.tasks import TASKS, schema

    kwargs = dict(model=cfg["model"], max_num_seqs=cfg["seqs"],
                  structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
    if read["graphs"]:  # +cgN: CUDA graphs for steps of up to N tokens
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": graph_sizes(read["graphs"])}
    if method or stats:  # the draft counters need vLLM's stats; +stats: as batchjson's engine runs (its report)
        kwargs["disable_log_stats"] = False
    if method:
        kwargs["speculative_config"] = speculative(method, schema(cfg["task"]), read["k"], read["av"]) | (
            {"model": cfg["draft"]} if method == "draft" else {})
    if current_platform.is_cpu():
        kwargs["enforce_eager"] = True
    llm = vllm.LLM(**kwargs)
    _, prompts, truths = task_prompts(cfg["task"], cfg["rows"], frame(llm, TASKS[cfg["task"]]["system"]))
    if fills == "free":  # each row's length (a file of them: one params a prompt), or one for all
        given = cfg["free_tokens"]
        lengths = json.loads(Path(given).read_text()) if isinstance(given, str) else [given] * len(prompts)
        params = [vllm.SamplingParams(temperature=0.0, max_tokens=max(1, n), ignore_eos=True) for n in lengths]
    else:  # batchjson's fills on the grammar batchjson gives xgrammar; vLLM's on the schema as written
        from batchjson.schema.grammar import choose

        written = schema(cfg["task"])
        given = choose(written, "xgrammar").grammar_schema if ours and not read["written"] else written
        params = vllm.SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"],
                                     structured_outputs=StructuredOutputsParams(json=given))
    flush = vllm.SamplingParams(temperature=0.0, max_tokens=1)

    def profiled() -> dict:  # the engine writes its profile every DUMP_EVERY_S: wait, step once, read
        time.sleep(DUMP_EVERY_S + 0.2)
        llm.generate(["{"], flush, use_tqdm=False)
        return read_profile(profile)

    before = profiled()
    sampler = HostSampler()
    sampler.start()
    spy = _spy(llm, cfg) if cfg.get("pyspy") else None
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    host = sampler.summary()
    after = profiled()
    drafted = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()
               if m.name.startswith("vllm:spec_decode_num")} if method else {}
    llm.llm_engine.engine_core.shutdown()
    steps = after["steps"] - before["steps"] - 1  # the flush's step
    scheduled = {f"{k}_per_step": round((after.get(k, 0) - before.get(k, 0)) / max(steps, 1), 1) for k in SCHEDULED}
    parts = {name: round(1000 * (after["parts"].get(name, {}).get("seconds", 0)
                                 - before["parts"].get(name, {}).get("seconds", 0)) / max(steps, 1), 2)
             for name in PARTS}
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    result = {"generate_s": round(seconds, 2), "steps": steps, "ms_per_step": round(1000 * seconds / max(steps, 1), 1),
              "output_tokens": sum(map(len, tokens)), "mean_tokens": round(sum(map(len, tokens)) / len(tokens), 1),
              "parts_ms_per_step": parts, **scheduled, "gpu_busy": host["gpu_util_mean"], "cpu_busy": host["cpu_busy_mean"],
              "batch_fill_calls": after["parts"].get("batch_fills", {}).get("count", 0),  # 0: vLLM's fills ran
              # steps whose grammar work went ahead
              "ahead_calls": max(after["parts"].get(p, {}).get("count", 0) for p in ("ahead", "ahead_fill")),
              "digests": [hashlib.md5(json.dumps(t).encode()).hexdigest()[:12] for t in tokens],
              "lengths": list(map(len, tokens))}
    if drafted:
        d, a = drafted.get("vllm:spec_decode_num_draft_tokens", 0), drafted.get("vllm:spec_decode_num_accepted_tokens", 0)
        result["acceptance"] = round(a / d, 3) if d else None
    if fills != "free":
        validator = Validator(schema(cfg["task"]))
        checked = [check(cfg["task"], validator, o.outputs[0].text, o.outputs[0].finish_reason or "", t)
                   for o, t in zip(outs, truths)]
        result |= {"valid": sum(c[0] for c in checked), "correct": sum(c[1] for c in checked)}
    if spy:
        result["pyspy"] = spy()
    return result


def _spy(llm, cfg: dict):
    """Start py-spy on the engine process 2 s from now for cfg["pyspy"] seconds; returns the call that waits for
    it and summarises its samples (the share in each grammar frame, and the top leaf functions)."""
    exe = shutil.which("py-spy")
    if not exe:
        return lambda: {"error": "py-spy is not installed"}
    try:
        pid = llm.llm_engine.engine_core.resources.engine_manager.processes[0].pid
    except AttributeError:
        return lambda: {"error": "no engine process"}
    raw = Path(cfg["profile"]).with_suffix(".spy.txt")
    box: dict = {}

    def record():
        time.sleep(2)
        idle = (["--idle"] if cfg.get("idle") else []) + (["--native"] if cfg.get("native") else [])
        box["rc"] = subprocess.run([exe, "record", "-p", str(pid), "-d", str(cfg["pyspy"]), "-r", "200", "-f", "raw",
                                    "-o", str(raw), "--nonblocking", "--threads", *idle],
                                   capture_output=True, text=True).returncode

    thread = threading.Thread(target=record, daemon=True)
    thread.start()

    def summary() -> dict:
        thread.join()
        return {"rc": box.get("rc"), "file": raw.name, **(spy_shares(raw) if raw.exists() else {})}

    return summary


def spy_shares(raw: Path) -> dict:
    """From py-spy's raw (collapsed) stacks: the share of samples under each grammar frame, the top leaves, each
    thread's share and top leaves (with --threads the first frame names the thread), and the top leaves under the
    forward's launch (execute_model: where its time goes, a wait for the interpreter's lock or for the GPU included
    with --idle and --native)."""
    total, under, leaves = 0, collections.Counter(), collections.Counter()
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    forward = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        for name in GRAMMAR_FRAMES:
            if any(name in f for f in frames):
                under[name] += n
        leaf = frames[-1][:120]
        leaves[leaf] += n
        threads[frames[0][:60]][leaf] += n
        if any("execute_model" in f for f in frames):
            forward[leaf] += n

    def top(counter, k):
        return [(key, round(v / max(total, 1), 3)) for key, v in counter.most_common(k)]

    busiest = sorted(threads.items(), key=lambda kv: -sum(kv[1].values()))[:4]
    return {"samples": total, "under": {k: round(v / max(total, 1), 3) for k, v in under.most_common()},
            "top_leaves": top(leaves, 12),
            "threads": {name: {"share": round(sum(c.values()) / max(total, 1), 3), "top_leaves": top(c, 8)}
                        for name, c in busiest},
            "forward": {"share": round(sum(forward.values()) / max(total, 1), 3), "top_leaves": top(forward, 12)}}


def matchers(tokenizer: str, task: str, rows: int, in_flight: int, steps: int, threads: int) -> dict:
    """xgrammar alone, no engine: `in_flight` matchers of the task's schema (as vLLM compiles it: no whitespace),
    each at its own place in a ground-truth answer tokenized by `tokenizer`, stepped `steps` times (a finished
    answer starts the next). Per step, ms: vLLM's fills (a Python call per row, serially; and in vLLM's thread pool
    of 16-row tasks), the batch matcher's one call, and the tokens' acceptance one call per row against one batch
    call; `fill_batchjson`: the batch call on the grammar batchjson gives xgrammar (schema/grammar.py: the schema
    without what xgrammar decodes badly, e.g. minLength), its matchers at the same places. The mask's size too."""
    import concurrent.futures

    import xgrammar as xgr
    from transformers import AutoTokenizer

    from batchjson.schema.grammar import choose
    from bench.tasks import schema

    tok = AutoTokenizer.from_pretrained(tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tok)
    compiler = xgr.GrammarCompiler(info)
    compiled = compiler.compile_json_schema(json.dumps(schema(task)), any_whitespace=False)
    ours = compiler.compile_json_schema(json.dumps(choose(schema(task), "xgrammar").grammar_schema),
                                        any_whitespace=False)
    answers = _answers(tok, lambda: xgr.GrammarMatcher(compiled), task, rows)
    if not answers:
        return {"error": "no answer of the task is accepted by its grammar with this tokenizer"}
    live, theirs = [], []
    for i in range(in_flight):  # staggered: a running batch holds rows at every point of their answers
        answer = answers[i % len(answers)]
        m, o = xgr.GrammarMatcher(compiled), xgr.GrammarMatcher(ours)
        at = i % len(answer)
        for t in answer[:at]:
            m.accept_token(t)
            o.accept_token(t)
        live.append([m, answer, at])
        theirs.append(o)
    mask = xgr.allocate_token_bitmask(in_flight, info.vocab_size)
    batch = xgr.BatchGrammarMatcher(threads)
    pool = concurrent.futures.ThreadPoolExecutor(threads)
    clock = collections.Counter()

    def timed(part, fn):
        t = time.perf_counter()
        fn()
        clock[part] += time.perf_counter() - t

    def serial():
        for i, (m, _, _) in enumerate(live):
            m.fill_next_token_bitmask(mask, i)

    def pooled():
        def task_of(lo):
            for i in range(lo, min(lo + 16, len(live))):
                live[i][0].fill_next_token_bitmask(mask, i)
        for f in [pool.submit(task_of, lo) for lo in range(0, len(live), 16)]:
            f.result()

    for _ in range(steps):
        timed("fill_serial", serial)
        timed("fill_pool", pooled)
        timed("fill_batch", lambda: batch.batch_fill_next_token_bitmask([r[0] for r in live], mask))
        timed("fill_batchjson", lambda: batch.batch_fill_next_token_bitmask(theirs, mask))
        nexts = [r[1][r[2]] for r in live]
        for o, t in zip(theirs, nexts):
            o.accept_token(t)
        timed("accept_each", lambda: [r[0].accept_token(t) for r, t in zip(live, nexts)])
        for r, t in zip(live, nexts):
            r[0].rollback(1)
        timed("accept_batch", lambda: xgr.BatchGrammarMatcher.batch_accept_token([r[0] for r in live], nexts))
        for r, o in zip(live, theirs):
            r[2] += 1
            if r[2] == len(r[1]):
                r[0].reset()
                o.reset()
                r[2] = 0
    return {"in_flight": in_flight, "threads": threads, "answers": len(answers), "vocab": info.vocab_size,
            "mask_mb": round(mask.numel() * 4 / 2**20, 1),
            **{f"{k}_ms": round(1000 * v / steps, 2) for k, v in sorted(clock.items())},
            **advance(tok, task, rows, in_flight, steps)}


def _answers(tok, matcher, task: str, rows: int) -> list[list[int]]:
    """The task's ground-truth answers as token ids the grammar takes (compact or with spaces, as it allows), each
    ended by the end token; `matcher()` makes a fresh matcher of the grammar."""
    from bench.tasks import rows as task_rows

    answers = []
    for _, _, truth in task_rows(task, rows):
        for separators in ((",", ":"), (", ", ": ")):
            probe = matcher()
            ids = tok.encode(json.dumps(json.loads(truth), separators=separators), add_special_tokens=False)
            if all(probe.accept_token(t) for t in ids):
                answers.append(ids + [tok.eos_token_id])
                break
    return answers


def advance(tok, task: str, rows: int, in_flight: int, steps: int) -> dict:
    """The grammar's advance of a step as update_from_output makes it, no engine: `in_flight` of vLLM's own
    XgrammarGrammar objects (its XgrammarBackend compiles the task's schema as an engine with disable_any_whitespace
    does), each at its own place in an answer, one token a step. Per step, CPU ms of this thread (time.thread_time:
    other jobs on the same cores slow a wall clock, not this), the median of the steps:

    advance_vllm    vLLM's call per request, the one its scheduler makes for a request's new token (0.32:
                    StructuredOutputManager.accept_tokens; 0.26: should_advance, trim_reasoning_for_advance, then
                    XgrammarGrammar.accept_tokens), through a manager without a reasoning parser;
    advance_batch   the least a batch advance must do instead: gather each request's matcher and token past the same
                    checks, one BatchGrammarMatcher.batch_accept_token, and vLLM's bookkeeping of each grammar
                    (num_processed_tokens, the termination). It leaves out the call per request that
                    update_from_output's loop still makes: the batch's best case, reached only by rewriting that loop;
    advance_lean    advance_batch plus the least call per request that loop would still make (0.32 only: a patched
                    StructuredOutputManager.accept_tokens that looks the request up and returns);
    advance_patched the batch as a patch of XgrammarGrammar.accept_tokens would install it in both versions: the
                    batch call, then vLLM's call per request, whose accept_tokens finds its token taken (and keeps
                    vLLM's bookkeeping; another token would go vLLM's own way).
    batch_saving, lean_saving, patched_saving: 1 - each / advance_vllm."""
    from types import SimpleNamespace

    import xgrammar as xgr
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend, XgrammarGrammar

    from bench.tasks import schema

    config = SimpleNamespace(structured_outputs_config=SimpleNamespace(disable_any_whitespace=True),
                             speculative_config=None, model_config=None)
    backend = XgrammarBackend(config, tok, len(tok))
    spec = json.dumps(schema(task))
    answers = _answers(tok, lambda: backend.compile_grammar(StructuredOutputOptions.JSON, spec).matcher, task, rows)
    if not answers:
        return {"advance_error": "no answer of the task is accepted by vLLM's grammar with this tokenizer"}
    manager = SimpleNamespace(enable_in_reasoning=False, reasoner_cls=None, _get_reasoner=lambda request: None)
    for name in ("_get_constraint_bounds", "should_advance", "trim_reasoning_for_advance"):
        if hasattr(StructuredOutputManager, name):
            setattr(manager, name, getattr(StructuredOutputManager, name).__get__(manager))
    if hasattr(StructuredOutputManager, "accept_tokens"):  # 0.32
        def vllm_advance(request, tokens):
            return StructuredOutputManager.accept_tokens(manager, request, tokens)
    else:  # 0.26: the scheduler's own lines
        def vllm_advance(request, tokens):
            if manager.should_advance(request):
                tokens = manager.trim_reasoning_for_advance(request, tokens)
                return request.structured_output_request.grammar.accept_tokens(request.request_id, tokens)
            return True
    live = []
    for i in range(in_flight):  # staggered, as in `matchers`
        answer, at = answers[i % len(answers)], i % len(answers[i % len(answers)])
        grammar = backend.compile_grammar(StructuredOutputOptions.JSON, spec)
        if at:
            assert grammar.accept_tokens("r", answer[:at])
        structured = SimpleNamespace(grammar=grammar, reasoning_ended=None, reasoning_end_token_index=None)
        live.append([SimpleNamespace(request_id=str(i), use_structured_output=True,
                                     structured_output_request=structured), answer, at])

    def gathered(news):
        grammars, tokens = [], []
        for request, token in news:
            grammar = request.structured_output_request.grammar
            if request.use_structured_output and type(grammar) is XgrammarGrammar and not grammar.is_terminated():
                grammars.append(grammar)
                tokens.append(token)
        return grammars, xgr.BatchGrammarMatcher.batch_accept_token([g.matcher for g in grammars], tokens), tokens

    def took(grammar):  # vLLM's bookkeeping of a grammar whose matcher took the step's token
        grammar.num_processed_tokens += 1
        grammar._is_terminated = grammar.matcher.is_terminated()

    def batch(news):
        for grammar, ok, _ in zip(*gathered(news)):
            if ok:
                took(grammar)

    own, taken = XgrammarGrammar.accept_tokens, {}

    def accept_taken(grammar, request_id, tokens):
        token = taken.pop(id(grammar), None)
        if token is not None and len(tokens) == 1 and tokens[0] == token:
            took(grammar)
            return True
        return own(grammar, request_id, tokens)

    def lean(news):
        done = {}
        for grammar, ok, _ in zip(*gathered(news)):
            if ok:
                took(grammar)
                done[id(grammar)] = True

        def accept_tokens(request, tokens):  # what a patched manager would still do per request
            return done.pop(id(request.structured_output_request.grammar), None) or vllm_advance(request, tokens)

        for request, token in news:
            accept_tokens(request, [token])

    def patched(news):
        taken.update((id(g), t) for g, ok, t in zip(*gathered(news)) if ok)
        XgrammarGrammar.accept_tokens = accept_taken
        try:
            for request, token in news:
                vllm_advance(request, [token])
        finally:
            XgrammarGrammar.accept_tokens = own

    clock = collections.defaultdict(list)  # way -> CPU seconds of each step
    for _ in range(steps):
        news = [(r[0], r[1][r[2]]) for r in live]
        t = time.thread_time()
        for request, token in news:
            vllm_advance(request, [token])
        clock["advance_vllm"].append(time.thread_time() - t)
        for request, _ in news:
            request.structured_output_request.grammar.rollback(1)
        for name, way in (("advance_batch", batch), ("advance_lean", lean), ("advance_patched", patched)):
            t = time.thread_time()
            way(news)
            clock[name].append(time.thread_time() - t)
            if way is not patched:  # the last way's tokens stay taken: the answers move on
                for request, _ in news:
                    request.structured_output_request.grammar.rollback(1)
        for r in live:
            r[2] += 1
            if r[2] == len(r[1]):
                r[0].structured_output_request.grammar = backend.compile_grammar(StructuredOutputOptions.JSON, spec)
                r[2] = 0
    ms = {k: 1000 * sorted(v)[len(v) // 2] for k, v in clock.items()}
    return {**{f"{k}_ms": round(v, 2) for k, v in ms.items()},
            **{f"{k}_saving": round(1 - ms[f"advance_{k}"] / ms["advance_vllm"], 2)
               for k in ("batch", "lean", "patched")}}


def masks(in_flight: int, drafts: int, vocab: int, repeat: int) -> dict:
    """vLLM's apply_grammar_bitmask against batchjson's on one step of `in_flight` requests with `drafts` drafted
    positions each: random masks in pinned memory (as BatchFills leaves them), the scheduler's order the reverse of
    the batch's, bfloat16 logits on a GPU (float32 on a CPU)."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.structured_output.utils import apply_grammar_bitmask

    from batchjson.engine.vllm.masks import apply_mask_rows, mask_rows

    gpu = torch.cuda.is_available()
    device, words, rows = ("cuda" if gpu else "cpu"), (vocab + 31) // 32, in_flight * (1 + drafts)
    req_ids = [f"r{i}" for i in range(in_flight)]
    scheduled = SimpleNamespace(scheduled_spec_decode_tokens={r: [0] * drafts for r in req_ids} if drafts else {})
    bitmask = torch.empty((rows, words), dtype=torch.int32, pin_memory=gpu)
    bitmask.copy_(torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32))
    grammar = SimpleNamespace(grammar_bitmask=bitmask.numpy(), structured_output_request_ids=req_ids[::-1])
    batch = SimpleNamespace(req_ids=req_ids)
    logits = torch.randn((rows, vocab), dtype=torch.bfloat16 if gpu else torch.float32, device=device)
    sync = torch.cuda.synchronize if gpu else (lambda: None)

    def ours(out):
        kept, targets = mask_rows(batch.req_ids, grammar.structured_output_request_ids,
                                  scheduled.scheduled_spec_decode_tokens)
        apply_mask_rows(grammar.grammar_bitmask, kept, targets, out)

    result, masked = {"in_flight": in_flight, "drafts": drafts, "rows": rows, "device": device,
                      "mask_mb": round(bitmask.numel() * 4 / 2**20, 1)}, {}
    for name, apply in (("vllm", lambda out: apply_grammar_bitmask(scheduled, grammar, batch, out)),
                        ("batchjson", ours)):
        cpu, done = [], []
        for i in range(repeat + 1):  # the first is a warm-up (allocations, the kernels' compile)
            out = logits.clone()
            sync()
            t0 = time.perf_counter()
            apply(out)
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            if i:
                cpu.append(t1 - t0)
                done.append(t2 - t0)
        masked[name] = out
        result |= {f"{name}_cpu_ms": round(1000 * sorted(cpu)[len(cpu) // 2], 2),
                   f"{name}_done_ms": round(1000 * sorted(done)[len(done) // 2], 2)}
    result["equal"] = bool(torch.equal(masked["vllm"], masked["batchjson"]))
    return result


def main(argv: list[str]) -> int:
    if answer_one(argv, one):
        return 0
    ap = argparse.ArgumentParser(prog="python -m bench grammar", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the model folder (engine runs)")
    ap.add_argument("--task", default="C")
    ap.add_argument("--draft", help="the draft model's folder (configurations <cfg>-draft)")
    ap.add_argument("--rows", type=int, default=6000)
    ap.add_argument("--seqs", default="1024", help="vLLM max_num_seqs values, comma-separated")
    ap.add_argument("--configs", default="vllm,batch,free")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--budget", type=float, default=0, help="stop starting configurations after this many seconds")
    ap.add_argument("--pyspy", type=int, default=0, help="seconds of py-spy sampling per configuration (0: none)")
    ap.add_argument("--idle", action="store_true", help="py-spy keeps the samples of waiting threads (a lock's too)")
    ap.add_argument("--native", action="store_true", help="py-spy samples native frames too (CUDA's, the lock's)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--matchers", metavar="TOKENIZER", help="xgrammar alone, no engine (see `matchers`): the "
                    "tokenizer's folder (a model's); --seqs are the matchers in flight, --threads the fill threads")
    ap.add_argument("--threads", type=int, default=max(1, min((os.cpu_count() or 2) // 2, 8)))
    ap.add_argument("--masks", action="store_true", help="the masks' application alone, no engine (see `masks`): "
                    "--seqs requests in flight, --drafts drafted positions each, --vocab tokens")
    ap.add_argument("--drafts", default="0,4,8")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args(argv)
    if args.masks:
        args.out.mkdir(parents=True, exist_ok=True)
        got = [masks(int(n), int(k), args.vocab, args.repeat) for n in args.seqs.split(",")
               for k in args.drafts.split(",")]
        dump(args.out / "masks.json", got)
        print(table(got, [(k, k) for k in got[0]]))
        return 0 if all(g["equal"] for g in got) else 1
    if args.matchers:
        args.out.mkdir(parents=True, exist_ok=True)
        got = [matchers(args.matchers, args.task, min(args.rows, 500), int(n), 50, args.threads)
               for n in args.seqs.split(",")]
        dump(args.out / f"matchers-{args.task}.json", got)
        print(table(got, [(k, k) for k in got[0]]))
        return 1 if any("error" in g for g in got) else 0
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"grammar-{args.task}-{args.rows}.json"
    results: list[dict] = []
    began = time.monotonic()
    for seqs in [int(s) for s in args.seqs.split(",")]:
        for name in args.configs.split(","):
            if args.budget and time.monotonic() - began > args.budget:
                results.append({"name": name, "seqs": seqs, "error": "budget spent"})
                continue
            read = parse(name)
            fills, method = read["fills"], read["method"]
            firsts = [r for r in results if r["seqs"] == seqs and r.get("method") == method and "mean_tokens" in r
                      and r["fills"] != "free"]
            free_tokens = args.max_tokens  # free's lengths: the first schema run's, each row's or their mean
            if firsts:
                free_tokens = max(1, round(firsts[0]["mean_tokens"])) if read["mean"] else firsts[0]["lengths_file"]
            cfg = {"name": name, "seqs": seqs, "model": args.model, "draft": args.draft, "task": args.task,
                   "rows": args.rows, "max_tokens": args.max_tokens, "pyspy": args.pyspy, "idle": args.idle, "native": args.native,
                   "free_tokens": free_tokens,
                   "profile": str(args.out / f"profile-{name}-{seqs}.json"),
                   "result": str(args.out / f"result-{name}-{seqs}.json")}
            Path(cfg["profile"]).unlink(missing_ok=True)
            t0 = time.monotonic()
            row = one_process("grammar", cfg, args.timeout, env=os.environ | {"PYTHONUNBUFFERED": "1"})
            row |= {"name": name, "seqs": seqs, "fills": fills, "method": method, "wall_s": round(time.monotonic() - t0, 1)}
            same = [r for r in results if r["seqs"] == seqs and "digests" in r
                    and (r["fills"] == "free") == (fills == "free")]
            if same and "digests" in row:
                row["differ"] = sum(a != b for a, b in zip(same[0]["digests"], row["digests"]))
                row["differ_from"] = same[0]["name"]
            if "lengths" in row:  # the rows' lengths, for a later `free`
                row["lengths_file"] = str(args.out / f"lengths-{len(results)}-{name}-{seqs}.json")
                dump(Path(row["lengths_file"]), row.pop("lengths"))
            results.append(row)
            dump(path, results)
            print(json.dumps({k: v for k, v in row.items() if k != "digests"}), flush=True)
    for r in results:
        r |= {f"{p}_ms": r.get("parts_ms_per_step", {}).get(p) for p in PARTS}
    print(table(results, [("seqs", "seqs"), ("name", "config"), ("generate_s", "generate s"), ("steps", "steps"),
                          ("ms_per_step", "ms/step"), ("schedule_ms", "schedule"), ("update_from_output_ms", "update"),
                          ("advance_ms", "advance"),
                          ("get_grammar_bitmask_ms", "masks"), ("ahead_ms", "ahead"),
                          ("ahead_advance_ms", "its advance"), ("ahead_fill_ms", "its fill"),
                          ("scheduled_requests_per_step", "requests"),
                          ("drafted_tokens_per_step", "drafted"),
                          ("forward_ms", "forward"), ("sample_tokens_ms", "sample"), ("propose_ms", "propose"),
                          ("drafts_ms", "drafts"), ("gc_ms", "gc"), ("gpu_busy", "GPU %"),
                          ("mean_tokens", "mean tok"), ("valid", "valid"), ("correct", "correct"),
                          ("differ", "differ"), ("error", "error")]))
    return 1 if any("error" in r for r in results) else 0
