"""Which repetition_detection settings would have stopped a finished run's looping rows, and how early.

    python -m bench repetition-scan RUN_DIR [--model MODEL_DIR] [--rejects REJECTS_DIR]

RUN_DIR is the output folder of a run made without [sampling.repetition_detection]: its pass-1 failures
(re-queued for pass 2, or rejected; raw text) are the loops, its valid rows the outputs that must not be stopped.
The files are found through the run's commit records (batchjson.storage), not by their names. Each output is
re-tokenized and fed to vLLM's own check token by token, as the scheduler does while decoding.
"""

from __future__ import annotations

import argparse

SETTINGS = [(8, 6), (16, 4), (24, 3), (48, 4)]


def texts(run: str, rejects: str | None) -> tuple[list[str], list[str]]:
    """(raw texts of the pass-1 failures, texts of the valid rows of both passes) of a finished run."""
    from batchjson.records import Stage
    from batchjson.storage import Storage

    commits = Storage(run, rejects).commits
    failed, valid = [], []
    for record in commits.records():
        stage, key, files = record["stage"], record["key"], record["files"]
        if "output" in files:
            valid += commits.read_ids(stage, key, "output", ["json"]).column(0).to_pylist()
        if stage == Stage.FIRST:
            for kind in ("requeue", "rejects"):
                if kind in files:
                    failed += commits.read_ids(stage, key, kind, ["raw_text"]).column(0).to_pylist()
    return failed, valid


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench repetition-scan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="the run's output folder")
    ap.add_argument("--model", default="default", help='the model whose tokenizer the run used ("default": SmolLM2)')
    ap.add_argument("--rejects", help="the run's rejects folder, if output.rejects moved it out of RUN/_rejects")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer
    from vllm.sampling_params import RepetitionDetectionParams
    from vllm.v1.core.sched.utils import check_sequence_repetition

    from batchjson.engine import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(args.model))
    failed, valid = texts(args.run, args.rejects)
    loops = [tok(t, add_special_tokens=False)["input_ids"] for t in failed]
    valid_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in valid]
    print(f"{len(loops)} failed pass-1 rows, {len(valid_ids)} valid rows")
    if not valid_ids:
        print(f"no committed valid rows in {args.run}: not a finished run's output folder?")
        return 1
    for max_pattern, min_count in SETTINGS:
        params = RepetitionDetectionParams(max_pattern_size=max_pattern, min_count=min_count)

        def stop_at(ids):
            return next((n for n in range(1, len(ids) + 1) if check_sequence_repetition(ids[:n], params)), None)

        caught = [n for n in map(stop_at, loops) if n]
        hits = sum(stop_at(ids) is not None for ids in valid_ids)
        print(f"max_pattern_size={max_pattern} min_count={min_count}: stops {len(caught)}/{len(loops)} failed rows "
              f"(mean at token {sum(caught) / max(1, len(caught)):.0f}); would stop {hits}/{len(valid_ids)} valid rows")
    return 0
