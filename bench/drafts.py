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
"""

from __future__ import annotations

import argparse
import json
import time
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


def measure(task: str, rows: int, ks: list[int], tokenizer: str) -> list[dict]:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from batchjson.schema.drafts import Drafter, PromptIndex, copy_after
    from bench.tasks import TASKS, rows as task_rows, schema

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
            if not cases:
                raise SystemExit(f"task {task}: no answer is taken by its grammar with this tokenizer")
            out.append({"task": task, "k": k, "config": name, "rows": len(cases), "tokens": tokens, "steps": steps,
                        "tokens_per_step": round(tokens / max(steps, 1), 2),
                        "steps_saved": round(1 - steps / max(tokens, 1), 3),
                        "acceptance": round(accepted / proposed, 3) if proposed else None,
                        "proposing": round(proposing / max(steps, 1), 3),
                        "us_per_step": round(1e6 * (time.perf_counter() - t0) / max(steps, 1), 1)})
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench drafts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="A,B,C")
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--ks", default="4,8")
    ap.add_argument("--tokenizer", default="default", help='a tokenizer (model) folder, or "default" (the embedded SmolLM2)')
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    from batchjson.engine import resolve_model

    tokenizer = resolve_model("default") if args.tokenizer == "default" else args.tokenizer
    if not Path(tokenizer).is_dir():
        ap.error(f"--tokenizer: no folder at {tokenizer}")
    ks = [int(k) for k in args.ks.split(",")]
    results = [r for task in args.tasks.split(",") for r in measure(task, args.rows, ks, tokenizer)]
    args.out.mkdir(parents=True, exist_ok=True)
    dump(args.out / "drafts.json", {"tokenizer": tokenizer, "rows": args.rows, "results": results})
    print(table(results, [(c, c.replace("_", " ")) for c in (
        "task", "k", "config", "rows", "tokens_per_step", "steps_saved", "acceptance", "proposing", "us_per_step")]))
    return 0
