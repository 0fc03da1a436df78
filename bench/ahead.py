"""The grammars' work beside the forward's launch (engine/vllm/ahead.py GrammarAhead) on vLLM 0.26's or 0.34's own
scheduler, with no GPU: that vLLM's Python (its AsyncScheduler, StructuredOutputManager with the xgrammar backend, and
EngineCore.step_with_batch_queue, which runs as it does in the engine process) over the installed CPU build drives a
fake model runner on this CPU. The runner answers each request with its ground-truth JSON, token by token, and checks
every mask row it is given against a matcher of its own; a run passes when every answer comes back whole and every
row matched.

    python -m bench ahead --vllm-src DIR --configs ahead,batch,free --rows 2048 --seqs 1024 --launch-ms 25 \\
        --check 0 --repeat 2 --out OUT

Configurations, each in its own process with DIR first on its path: `ahead` (GrammarAhead on), `batch` (batchjson's
batch fills when vLLM asks for the masks), `vllm` (vLLM's own fills), `free` (no grammar, the same tokens:
ignore_eos, max_tokens = the answer's length). `--launch-ms` spends that much of the engine core thread's CPU time in
Python in each forward's launch, as Model Runner V2's input preparation does (24 ms a step for the 1.5B at 1,024 in
flight on the H200 host): the window the grammar work can go beside. ms per step: the loop's wall time over its steps;
core_cpu: the CPU time of the engine core's thread (the launch's busy wait included), which bounds the step where a
spare core runs the grammar's thread; ahead_cpu: that thread's CPU time (GrammarAhead.work, fill_beside); wait: the
engine core thread's wait for that thread (in update_from_output and get_grammar_bitmask). `--sync` schedules one step
at a time (EngineCore.step, as vLLM 0.26 does with n-gram, suffix or draft-model drafts), where only the fill goes on
the thread; `--drafts K` then proposes the answer's next K tokens (one request in three with a wrong second token)
for vLLM to cut and verify; without `--sync` (0.34 only) vLLM schedules the drafts ahead, unchecked, as Model Runner V2
does. `--no-draft-every N`: every Nth request asks for no drafts (NO_DRAFT); every request runs the loop guard.
Results: OUT/ahead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench.common import ROOT, answer_one, dump, one_process, table

VERSIONS = ("0.26.0", "0.34.0")  # the vLLM versions whose Python this runs on (`make install`: .venv/vllm-0.26, -0.34)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                           "n": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "city", "n", "tags"], "additionalProperties": False}
WORDS = [("ann", "oslo"), ("bo", "rome"), ("cy", 'new "york"'), ("dee\\x", "lima"), ("e", "a\nb")]  # escapes too


def answers_for(tokenizer, compiled, rows: int, separators=(", ", ": ")) -> dict[str, list[int]]:
    """Each row's answer as tokens the grammar takes (the tokenizer's own split), then the end token."""
    import xgrammar as xgr

    out = {}
    for i in range(rows):
        name, city = WORDS[i % len(WORDS)]
        text = json.dumps({"name": name * (1 + i % 3), "city": city, "n": i, "tags": ["t"] * (i % 4)},
                          separators=separators)
        ids = tokenizer.encode(text, add_special_tokens=False)
        probe = xgr.GrammarMatcher(compiled)
        assert all(probe.accept_token(t) for t in ids), text
        out[str(i)] = ids + [tokenizer.eos_token_id]
    return out


def one(cfg: dict) -> dict:
    """One configuration in this process (vLLM 0.26's or 0.34's Python first on the path)."""
    import queue
    from collections import deque
    from concurrent.futures import Future
    from types import SimpleNamespace

    import numpy as np
    import torch
    import xgrammar as xgr

    # imports no vLLM: its settings below come first
    from batchjson.engine.vllm import ahead as wing_ahead, ahead_hooks, fills
    from batchjson.engine.vllm import scheduler as wing_scheduler

    os.environ[wing_ahead.AHEAD_ENV] = "1" if cfg["name"] in ("ahead", "late") else "0"
    os.environ[wing_ahead.AHEAD_FROM_ENV] = "update" if cfg["name"] == "late" else "launch"
    os.environ[fills.GRAMMAR_FILLS_ENV] = "batch"
    import vllm
    from transformers import AutoTokenizer
    from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, StructuredOutputsConfig,
                             VllmConfig)
    from vllm.sampling_params import RepetitionDetectionParams, SamplingParams, StructuredOutputsParams
    from vllm.config import SpeculativeConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    assert vllm.__version__ in VERSIONS, vllm.__version__
    strided = vllm.__version__ >= "0.34"  # a request's mask rows: a block of k + 1 (0.34), else 1 + its drafts
    assert strided or cfg["sync"] or not cfg["drafts"], "--drafts: with --sync on vLLM 0.26 (its n-gram drafts)"
    indexed = "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__  # 0.26's field, gone in 0.34

    def runner_output(req_ids, **fields):
        if indexed:
            fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
        return ModelRunnerOutput(req_ids=req_ids, **fields)
    installed = {"no_draft": wing_scheduler.install_no_draft(), "guard": wing_scheduler.install_fast_loop_guard(),
                 "idle_drafter": wing_scheduler.install_idle_drafter() if strided else "off",  # 0.26's: the V1 runner's
                 "fills": fills.install_batch_fills() if cfg["name"] != "vllm" else "off",
                 "ahead": ahead_hooks.install_grammar_ahead() if cfg["name"] in ("ahead", "late") else "off"}
    jobs = {"work": 0, "served": 0, "moved": 0, "thread_s": 0.0, "wait_s": 0.0, "launch_s": 0.0, "fills": 0,
            "no_draft_drafted": 0}
    ahead = wing_ahead.GrammarAhead
    masks, advanced = ahead.masks, ahead.advanced

    def counted(method):  # the thread's work: its CPU time, and whether it served the step
        def call(self, *args):
            began = time.thread_time()
            got = method(self, *args)
            jobs["thread_s"] += time.thread_time() - began
            jobs["work"] += 1
            jobs["served"] += got is not None
            return got
        return call

    def timed_advanced(self, updated):
        began = time.perf_counter()
        got = advanced(self, updated)
        jobs["wait_s"] += time.perf_counter() - began
        return got

    def counted_masks(self, scheduled):
        jobs["moved"] += len(self.moved)
        began = time.perf_counter()
        got = masks(self, scheduled)
        jobs["wait_s"] += time.perf_counter() - began
        return got

    ahead.work, ahead.fill_beside = counted(ahead.work), counted(ahead.fill_beside)
    bitmask = fills.BatchFills.bitmask

    def fills_counted(self, *args):  # the steps whose masks BatchFills made (not vLLM's own)
        got = bitmask(self, *args)
        jobs["fills"] += got is not None
        return got

    fills.BatchFills.bitmask = fills_counted
    if cfg["name"] == "late":  # the thread's work is the fill alone (advanced() advances on the engine core's thread)
        ahead.fill_next = counted(ahead.fill_next)
    ahead.masks, ahead.advanced = counted_masks, timed_advanced
    if cfg["min_requests"]:
        ahead.min_requests = cfg["min_requests"]

    free, rows, check, sync, k = cfg["name"] == "free", cfg["rows"], cfg["check"], cfg["sync"], cfg["drafts"]
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    config = VllmConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=cfg["seqs"], max_num_batched_tokens=65536, max_model_len=4096,
                                         enable_chunked_prefill=True, async_scheduling=not sync,
                                         is_encoder_decoder=False),
        model_config=ModelConfig(model=cfg["model"], dtype="float16", seed=42),
        cache_config=CacheConfig(block_size=16, gpu_memory_utilization=0.9, cache_dtype="auto",
                                 enable_prefix_caching=False),
        device_config=DeviceConfig(device="cpu"),
        structured_outputs_config=StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True),
        speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=4,
                                             prompt_lookup_min=2) if k else None)
    config.cache_config.num_gpu_blocks = 100_000
    kv = KVCacheConfig(num_blocks=100_000, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    manager = StructuredOutputManager(config)
    scheduler = (Scheduler if sync else AsyncScheduler)(vllm_config=config, kv_cache_config=kv,
                                                         structured_output_manager=manager, block_size=16)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=config.model_config.get_vocab_size())
    separators = (",", ":") if strided else None  # 0.34 compiles with them (disable_any_whitespace)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                             separators=separators)
    answers = answers_for(tok, compiled, rows, separators or (", ", ": "))
    twins: dict = {}  # request -> a matcher of the runner's own, from vLLM's compiler (0.34's drops special tokens)
    twin_mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    releasing, small = cfg.get("launch_releases", False), torch.zeros(8)
    checked = [0]

    class Output:  # Model Runner V2's AsyncOutput, as vLLM and GrammarAhead read it: a row of 1 + k tokens a request
        def __init__(self, req_ids, tokens):
            self.model_runner_output = runner_output(req_ids)
            self.sampled_token_ids = np.zeros((len(tokens), 1 + k), dtype=np.int64)
            for row, got in enumerate(tokens):
                self.sampled_token_ids[row, :len(got)] = got
            self.num_sampled_tokens_np = np.array([len(t) for t in tokens], dtype=np.int32)
            self.copy_event = SimpleNamespace(synchronize=lambda: None)

        def get_output(self):
            self.model_runner_output.sampled_token_ids = [
                row[:n] for row, n in zip(self.sampled_token_ids.tolist(), self.num_sampled_tokens_np.tolist())]
            return self.model_runner_output

    class OutputFuture(Future):  # UniProcExecutor's AsyncOutputFuture
        def __init__(self, output):
            super().__init__()
            self.async_output = output

        def result(self, timeout=None):
            if not self.done():
                self.set_result(self.async_output.get_output())
            return super().result()

    class Runner:
        """The model runner: each request's next answer token, its mask row checked first."""

        def __init__(self):
            self.sampled: dict[str, list[int]] = {}
            self.step = None
            handler = SimpleNamespace(_draft_tokens_by_req={}, copy_event=SimpleNamespace(synchronize=lambda: None))
            self.driver_worker = SimpleNamespace(worker=SimpleNamespace(model_runner=SimpleNamespace(
                draft_tokens_handler=handler)))  # UniProcExecutor's path to Model Runner V2's drafts

        def execute_model(self, scheduler_output, non_block=False):
            self.step = scheduler_output
            began = time.perf_counter()
            end = time.thread_time() + cfg["launch_ms"] / 1000
            while time.thread_time() < end:  # the forward's launch: this much CPU of the engine core's thread
                sum(range(200))
                if releasing:  # a torch call, which lets go of the interpreter's lock as the runner's do
                    torch.add(small, 1, out=small)
            jobs["launch_s"] += time.perf_counter() - began
            done = Future()
            done.set_result(None if scheduler_output.total_num_scheduled_tokens
                            else runner_output([]))
            return done

        def check_rows(self, req_id, bitmask, first, drafts, at):
            """The request's mask rows (one per drafted position, then the bonus one) against its twin matcher
            advanced through the drafts before each (-1 once the grammar has ended; 0.34: and after a draft it
            refuses, as its check keeps one refused draft)."""
            twin, moved, cut = twins[req_id], 0, False
            for j in range(len(drafts) + 1):
                if twin.is_terminated() or cut:
                    twin_mask.fill_(-1)
                else:
                    twin.fill_next_token_bitmask(twin_mask)
                row = torch.from_numpy(np.ascontiguousarray(bitmask[first + j]))
                assert torch.equal(row, twin_mask[0]), f"request {req_id}: its mask differs at token {at}+{j}"
                checked[0] += 1
                if j < len(drafts) and not twin.is_terminated() and not cut:
                    cut = drafts[j] == -1 or not twin.accept_token(drafts[j])
                    assert strided or not cut, (req_id, at, j)  # 0.26 keeps only the valid prefix
                    moved += not cut
            if moved:
                twin.rollback(moved)

        def sample_tokens(self, grammar_output, non_block=False):
            step, self.step = self.step, None
            req_ids = list(step.num_scheduled_tokens)[::-1]  # the runner's own order
            drafted = step.scheduled_spec_decode_tokens
            first, row = {}, 0
            for r in ([] if grammar_output is None else grammar_output.structured_output_request_ids):
                first[r] = row
                row += 1 + (k if strided else len(drafted.get(r, ())))
            sampled = []
            for req_id in req_ids:
                got, answer = self.sampled.setdefault(req_id, []), answers[req_id]
                if len(got) >= len(answer):  # it finished at the step before: its tokens are dropped
                    sampled.append([0])
                    continue
                drafts = list(drafted.get(req_id, ()))
                assert not sync or -1 not in drafts  # ahead of time (0.34), the slots left empty are -1
                if -1 in drafts:
                    drafts = drafts[:drafts.index(-1)]
                jobs["no_draft_drafted"] += bool(drafts) and req_id in no_draft
                if check and not free:
                    assert req_id in first, f"request {req_id}: no mask row at token {len(got)}"
                    self.check_rows(req_id, grammar_output.grammar_bitmask, first[req_id], drafts, len(got))
                taken = 0  # greedy verification: drafts kept while they are the answer's next tokens
                ahead_of = answer[len(got):]
                while taken < min(len(drafts), len(ahead_of)) and drafts[taken] == ahead_of[taken]:
                    taken += 1
                new = answer[len(got):len(got) + taken + 1] or [0]
                if check and not free:
                    for t in new:
                        if not twins[req_id].is_terminated():
                            assert twins[req_id].accept_token(t)
                got.extend(new)
                sampled.append(new)
            if k:
                self.propose()
            if not non_block:  # one step at a time: the tokens as they are
                return runner_output(req_ids, sampled_token_ids=sampled)
            return OutputFuture(Output(req_ids, sampled))

        def propose(self):
            """After a step's sampling, as Model Runner V2's drafter and DraftTokensHandler.set_draft_tokens: the next
            k tokens of each answer, one in three with its second token changed (a draft the target refuses there, or
            the grammar cuts), kept by request on the host."""
            drafted = self.driver_worker.worker.model_runner.draft_tokens_handler._draft_tokens_by_req
            drafted.clear()
            for req_id, got in self.sampled.items():
                answer = answers[req_id]
                if len(got) >= len(answer):
                    continue
                d = list(answer[len(got):len(got) + k])
                if int(req_id) % 3 == 0 and len(d) > 1:
                    d[1] = answer[0]  # "{": wrong inside a value
                drafted[req_id] = np.array(d, dtype=np.int64)

        def take_draft_token_ids(self):
            drafted = self.driver_worker.worker.model_runner.draft_tokens_handler._draft_tokens_by_req
            return DraftTokenIds(list(drafted), [d.tolist() for d in drafted.values()]) if drafted else None

    core = object.__new__(EngineCore)  # its step_with_batch_queue as the engine process runs it
    core.vllm_config, core.scheduler, core.model_executor = config, scheduler, Runner()
    core.structured_output_manager = manager
    core.batch_queue_size, core.batch_queue = 2, deque(maxlen=2)
    core.is_ec_consumer, core.is_pooling_model, core.log_stats = True, False, False
    core.async_scheduling, core.check_for_draft_tokens = not sync, bool(k)
    core.aborts_queue = queue.Queue()
    core.is_mm_encoder_only, core._weight_version = False, None  # 0.34's (0.26 reads neither)

    every = cfg.get("no_draft_every", 0)  # every this many requests asks for no drafts (NO_DRAFT), from the first
    no_draft = {str(i) for i in range(rows) if every and i % every == 0}
    guard = RepetitionDetectionParams(max_pattern_size=16, min_count=8)  # the loop guard runs at every token
    for i in range(rows):
        extra = {"extra_args": {wing_scheduler.NO_DRAFT: True}} if str(i) in no_draft else {}
        if free:
            params = SamplingParams(temperature=0.0, max_tokens=len(answers[str(i)]), ignore_eos=True, **extra)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=200, repetition_detection=guard, **extra,
                                    structured_outputs=StructuredOutputsParams(json=SCHEMA))
            params.update_from_generation_config({}, eos_token_id=tok.eos_token_id)
            params.structured_outputs._backend = "xgrammar"  # as vLLM's input processing sets it
        request = Request(str(i), tok.encode(f"row {i}: the JSON", add_special_tokens=False), params, None)
        if not free:
            manager.grammar_init(request)
        scheduler.add_request(request)
    if strided and no_draft:  # the idle drafter's answer: a no-draft request's drafts are unused, another's are not
        flagged, other = (scheduler.requests[r] for r in (min(no_draft), next(r for r in answers if r not in no_draft)))
        jobs["drafts_unused"] = [scheduler._drafts_unused(r, r.num_tokens - 1, 1) for r in (flagged, other)]
    if not free:
        twin = manager.backend.compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                            **({"separators": separators} if separators else {}))
        twins.update({r: xgr.GrammarMatcher(twin) for r in answers})
    texts: dict[str, list[int]] = {}
    steps, start, cpu = 0, time.perf_counter(), time.thread_time()
    while scheduler.has_requests() or core.batch_queue:
        if sync:
            outputs, executed = core.step()
            core.post_step(executed)  # the drafts for the next step (take_draft_token_ids)
        else:
            outputs, executed = core.step_with_batch_queue()
        steps += bool(executed)  # a step that ran the model (not one that waited for a grammar's compile)
        for eco in (outputs or {}).values():
            for o in eco.outputs:
                texts.setdefault(o.request_id, []).extend(o.new_token_ids)
    seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
    thread_s, wait_s, launch_s = jobs.pop("thread_s"), jobs.pop("wait_s"), jobs.pop("launch_s")
    return {"installed": installed, "steps": steps, "ms_per_step": round(1000 * seconds / steps, 2),
            "core_cpu_ms_per_step": round(1000 * cpu / steps, 2),
            "ahead_cpu_ms_per_step": round(1000 * thread_s / steps, 2),
            "wait_ms_per_step": round(1000 * wait_s / steps, 2),
            "launch_ms_per_step": round(1000 * launch_s / steps, 2),
            "right": sum(texts.get(r) == a for r, a in answers.items()), "checked_rows": checked[0], **jobs}


def main(argv: list[str]) -> int:
    if answer_one(argv, one):
        return 0
    ap = argparse.ArgumentParser(prog="python -m bench ahead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-src", type=Path, help="a folder of vLLM 0.26's or 0.34's Python files (make install: "
                    ".venv/vllm-0.26, .venv/vllm-0.34; tests/vllm_sources.py fetches them)")
    ap.add_argument("--configs", default="ahead,batch")
    ap.add_argument("--repeat", type=int, default=1, help="the configurations in turn, this many times")
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--seqs", type=int, default=64, help="vLLM's max_num_seqs")
    ap.add_argument("--launch-ms", type=float, default=0.0)
    ap.add_argument("--launch-releases", action="store_true",
                    help="the launch calls torch between its Python (which lets the interpreter's lock go)")
    ap.add_argument("--check", type=int, default=1, help="1: check every mask row (0 for timings)")
    ap.add_argument("--model", default=None, help="a model folder for its tokenizer and config (default SmolLM2)")
    ap.add_argument("--min-requests", type=int, default=0, help="GrammarAhead.min_requests (0: its own)")
    ap.add_argument("--no-draft-every", type=int, default=0, help="every this many requests asks for no drafts")
    ap.add_argument("--sync", action="store_true", help="one step at a time (vLLM's EngineCore.step, as with drafts)")
    ap.add_argument("--drafts", type=int, default=0, help="k drafted tokens a step (with --sync): the answer's next k")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not args.vllm_src or not (args.vllm_src / "vllm").is_dir():
        ap.error("--vllm-src: a folder of vLLM's Python files (`make install` puts them in .venv/vllm-0.26, -0.34)")
    if args.model is None:
        from batchjson.engine.models import resolve_model

        args.model = resolve_model("default")  # converted once where this machine has not yet (a fresh CI machine)
    out = args.out or Path(os.environ.get("TMPDIR", "/tmp")) / "bench-ahead"
    out.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(args.vllm_src.resolve()), str(ROOT)]),
                        "PYTHONUNBUFFERED": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
    results = []
    for turn in range(args.repeat):
        for name in args.configs.split(","):
            cfg = {"name": name, "rows": args.rows, "seqs": args.seqs, "launch_ms": args.launch_ms,
                   "launch_releases": args.launch_releases,
                   "min_requests": args.min_requests, "sync": args.sync, "drafts": args.drafts,
                   "no_draft_every": args.no_draft_every,
                   "check": args.check, "model": args.model, "result": str(out / f"result-{name}.json")}
            row = one_process("ahead", cfg, args.timeout, env=env) | {
                "name": name, "turn": turn, "rows": args.rows, "seqs": args.seqs, "launch_ms": args.launch_ms,
                "sync": args.sync, "drafts": args.drafts}
            results.append(row)
            dump(out / "ahead.json", results)
            print(json.dumps(row), flush=True)
    print(table(results, [(k, k) for k in ("name", "turn", "seqs", "drafts", "launch_ms", "steps", "ms_per_step",
                                           "launch_ms_per_step", "core_cpu_ms_per_step", "ahead_cpu_ms_per_step",
                                           "wait_ms_per_step", "right", "checked_rows",
                                           "work", "served", "moved", "error")]))
    return 1 if any("error" in r or r["right"] != args.rows for r in results) else 0
