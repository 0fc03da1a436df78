"""What the schema drafter (batchjson/schema/drafts.py) would save, offline: each ground-truth answer of a task,
tokenized, decoded as a speculative engine with an exact verifier would decode it if the target wrote exactly that
answer: each step takes the drafter's proposal up to its first wrong token, plus the target's own token.

    python -m bench drafts --tasks A,B,C --rows 300 --ks 4,8 [--tokenizer MODEL_DIR] --out OUT

Configurations: `ngram` (vLLM's prompt lookup: the output's last 2-4 tokens found in the prompt or the output before
them, no grammar), `forced` (the canonical tokens of the grammar's forced continuation), `forced-trimmed` (its last
token dropped where what follows may join it), `copies` (copies from the prompt only), `schema` (the drafter's
default: forced, else a copy). Per task, tokenizer and k:
output tokens per step (1.0 without drafts), the share of steps saved, acceptance (accepted / proposed draft tokens),
and the share of steps that proposed anything (a step proposing nothing costs its verification nothing). An upper
bound where the target would write other tokens than the answer's canonical ones; the tokenizer is the embedded
SmolLM2's unless --tokenizer names another model folder (Qwen's on a GPU host). No engine: CPU, seconds.

    python -m bench drafts --cost --tasks C --rows 1024 --ks 8 [--tokenizer MODEL_DIR] --out OUT

the schema drafter's CPU per request and step, the rows decoding their answers in lockstep: as it was (a drafter in
the model runner with matchers of its own) and as it is (in the scheduler, on vLLM's own matchers; see `cost`).
"""

from __future__ import annotations

import argparse
import json
import time
import types
from pathlib import Path

from bench.common import dump, table

CONFIGS = ("ngram", "forced", "forced-trimmed", "copies", "schema")


def walk(drafter, compiled, prompt, answer: list[int]) -> tuple[int, int, int, int]:
    """Decode `answer` with `drafter`'s proposals verified against it: (steps, proposed, accepted, steps proposing)."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    i = steps = proposed = accepted = proposing = 0
    while i < len(answer):
        draft = drafter(matcher, prompt, answer[:i])
        a = 0
        while a < len(draft) and i + a < len(answer) and draft[a] == answer[i + a]:
            a += 1
        n = min(a + 1, len(answer) - i)  # the accepted drafts, then the target's own token
        for t in answer[i:i + n]:
            if not matcher.accept_token(t):
                raise AssertionError(f"the grammar refuses the answer's token {t} at {i}")
        steps, proposed, accepted, proposing = steps + 1, proposed + len(draft), accepted + a, proposing + bool(draft)
        i += n
    return steps, proposed, accepted, proposing


def task_cases(task: str, rows: int, tokenizer: str):
    """The task's grammar (xgrammar, as vLLM compiles it) and its rows as (prompt index, answer tokens + eos), the
    answers written with whichever separators the grammar takes; with the tokenizer's encode and vocabulary size."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from batchjson.schema.drafts import PromptIndex
    from bench.tasks import TASKS, rows as task_rows, schema

    if not json.loads(task_rows(task, 1)[0][2]):
        raise SystemExit(f"task {task} has no ground-truth answers to replay (its answers are free text)")
    tok = AutoTokenizer.from_pretrained(tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tok)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema(task)), any_whitespace=False)
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    cases = []
    for _, text, truth in task_rows(task, rows):
        probe = xgr.GrammarMatcher(compiled)
        for separators in ((", ", ": "), (",", ":")):  # the grammar's own separators, whichever they are
            answer = encode(json.dumps(json.loads(truth), separators=separators)) + [tok.eos_token_id]
            if all(probe.accept_token(t) for t in answer):
                cases.append((PromptIndex(encode(TASKS[task]["template"].format(text=text))), answer))
                break
            probe.reset()
    if not cases:
        raise SystemExit(f"task {task}: no answer is taken by its grammar with this tokenizer")
    return compiled, encode, info.vocab_size, cases


def measure(task: str, rows: int, ks: list[int], tokenizer: str) -> list[dict]:
    from batchjson.schema.drafts import Drafter, copy_after

    compiled, encode, _, cases = task_cases(task, rows, tokenizer)
    out = []
    for k in ks:
        drafters = {"ngram": lambda m, p, o, k=k: copy_after(o, [*p.prompt, *o], k, shortest=2),
                    "forced": Drafter(encode, k, copies=False).propose,
                    "forced-trimmed": Drafter(encode, k, copies=False, trim=True).propose,
                    "copies": Drafter(encode, k, forced=False).propose,
                    "schema": Drafter(encode, k).propose}
        for name in CONFIGS:
            t0, totals = time.perf_counter(), [0, 0, 0, 0]
            tokens = sum(len(a) for _, a in cases)
            for prompt, answer in cases:
                totals = [x + y for x, y in zip(totals, walk(drafters[name], compiled, prompt, answer))]
            steps, proposed, accepted, proposing = totals
            out.append({"task": task, "k": k, "config": name, "rows": len(cases), "tokens": tokens, "steps": steps,
                        "tokens_per_step": round(tokens / max(steps, 1), 2),
                        "steps_saved": round(1 - steps / max(tokens, 1), 3),
                        "acceptance": round(accepted / proposed, 3) if proposed else None,
                        "proposing": round(proposing / max(steps, 1), 3),
                        "us_per_step": round(1e6 * (time.perf_counter() - t0) / max(steps, 1), 1)})
    return out


class _Request:
    """The part of vLLM's scheduler Request that SchedulerDrafts reads."""

    def __init__(self, prompt, grammar):
        self.prompt_token_ids, self.output_token_ids, self.spec_token_ids = prompt, [], []
        self.structured_output_request = types.SimpleNamespace(grammar=grammar)
        self.use_structured_output, self.is_prefill_chunk = True, False

    def is_finished(self) -> bool:
        return False


def cost(task: str, rows: int, k: int, tokenizer: str) -> list[dict]:
    """The drafter's CPU a step, `rows` requests decoding their answers in lockstep (each step: the accepted drafts
    and one token of the answer), two ways, the same drafts: `runner` (before: a matcher of the drafter's own per
    request, advanced through each step's tokens, then vLLM's check of every draft: an accept per token and a
    rollback) and `scheduler` (engine/vllm/drafts.py SchedulerDrafts on vLLM's own matchers, which the engine has
    advanced anyway, the check skipped for forced strings that passed it once). vLLM's own advance is timed apart;
    the first step is not timed (lazy imports, each request's prompt index)."""
    import xgrammar as xgr
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    from batchjson.engine.vllm.drafts import SchedulerDrafts
    from batchjson.schema.drafts import COPY_MAX, Drafter

    compiled, encode, vocab, cases = task_cases(task, rows, tokenizer)
    ids = [str(i) for i in range(len(cases))]
    grammar = lambda: XgrammarGrammar(vocab_size=vocab, matcher=xgr.GrammarMatcher(compiled), ctx=compiled)  # noqa: E731
    scheduler = types.SimpleNamespace(requests={i: _Request(p.prompt, grammar()) for i, (p, _) in zip(ids, cases)})
    here = SchedulerDrafts(encode, k)
    drafter, own = Drafter(encode, k), [xgr.GrammarMatcher(compiled) for _ in cases]
    seconds = {"vllm_advance": 0.0, "runner": 0.0, "scheduler": 0.0}
    request_steps = steps = 0
    live = list(range(len(cases)))
    new = {i: [cases[i][1][0]] for i in live}  # the first token, from the prompt's step
    while live:
        t0 = time.perf_counter()
        for i in live:
            request = scheduler.requests[ids[i]]
            request.structured_output_request.grammar.accept_tokens(ids[i], new[i])
            request.output_token_ids.extend(new[i])
        t1 = time.perf_counter()
        before = []
        for i in live:  # the drafter as it was: its own matcher, then vLLM's check
            for token in new[i]:
                own[i].accept_token(token)
            output = scheduler.requests[ids[i]].output_token_ids
            draft = drafter.propose(own[i], cases[i][0], output[-COPY_MAX:]) if not own[i].is_terminated() else []
            before.append(scheduler.requests[ids[i]].structured_output_request.grammar.validate_tokens(draft))
        t2 = time.perf_counter()
        checked, forced = here.place(scheduler, [ids[i] for i in live])
        if checked.req_ids:
            for req_id, draft in zip(checked.req_ids, checked.draft_token_ids):  # vLLM's own check
                request = scheduler.requests[req_id]
                request.spec_token_ids = request.structured_output_request.grammar.validate_tokens(draft)
            here.learn(scheduler, checked, forced)
        t3 = time.perf_counter()
        if steps:  # the first step's lazy imports and prompt indexes are not a step's cost
            seconds["vllm_advance"] += t1 - t0
            seconds["runner"] += t2 - t1
            seconds["scheduler"] += t3 - t2
            request_steps += len(live)
        steps += 1
        for i, draft in zip(live, before):
            if scheduler.requests[ids[i]].spec_token_ids != draft:
                raise AssertionError(f"row {i}: the two ways drafted differently: {draft} against "
                                     f"{scheduler.requests[ids[i]].spec_token_ids}")
            answer, at = cases[i][1], len(scheduler.requests[ids[i]].output_token_ids)
            a = 0
            while a < len(draft) and at + a < len(answer) and draft[a] == answer[at + a]:
                a += 1
            new[i] = answer[at:at + a + 1]
        live = [i for i in live if len(scheduler.requests[ids[i]].output_token_ids) < len(cases[i][1])]
    return [{"task": task, "k": k, "way": way, "rows": len(cases), "steps": steps,
             "us_per_request_step": round(1e6 * s / max(request_steps, 1), 2),
             "ms_per_step_at_1024": round(1e3 * s / max(request_steps, 1) * 1024, 2)} for way, s in seconds.items()]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench drafts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="A,B,C")
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--ks", default="4,8")
    ap.add_argument("--tokenizer", default="default", help='a tokenizer (model) folder, or "default" (the embedded SmolLM2)')
    ap.add_argument("--cost", action="store_true", help="the drafter's CPU a step, as it was and as it is (see cost)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    from batchjson.engine import resolve_model

    tokenizer = resolve_model("default") if args.tokenizer == "default" else args.tokenizer
    if not Path(tokenizer).is_dir():
        ap.error(f"--tokenizer: no folder at {tokenizer}")
    ks = [int(k) for k in args.ks.split(",")]
    if args.cost:
        results = [r for task in args.tasks.split(",") for k in ks for r in cost(task, args.rows, k, tokenizer)]
        args.out.mkdir(parents=True, exist_ok=True)
        dump(args.out / "drafts-cost.json", {"tokenizer": tokenizer, "results": results})
        print(table(results, [(c, c.replace("_", " ")) for c in (
            "task", "k", "way", "rows", "steps", "us_per_request_step", "ms_per_step_at_1024")]))
        return 0
    results = [r for task in args.tasks.split(",") for r in measure(task, args.rows, ks, tokenizer)]
    args.out.mkdir(parents=True, exist_ok=True)
    dump(args.out / "drafts.json", {"tokenizer": tokenizer, "rows": args.rows, "results": results})
    print(table(results, [(c, c.replace("_", " ")) for c in (
        "task", "k", "config", "rows", "tokens_per_step", "steps_saved", "acceptance", "proposing", "us_per_step")]))
    return 0
