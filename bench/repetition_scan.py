"""Which repetition_detection settings would have stopped a finished run's looping rows, and how early.

    python bench/repetition_scan.py RUN_DIR [MODEL_DIR]

RUN_DIR is the output folder of a run made without [sampling.repetition_detection]: its pass-1 failures
(re-queue and rejects, raw text) are the loops, its valid rows the outputs that must not be stopped. Each output
is re-tokenized and fed to vLLM's own check token by token, as the scheduler does while decoding.
"""

import sys
from pathlib import Path

import pyarrow.parquet as pq
from transformers import AutoTokenizer
from vllm.sampling_params import RepetitionDetectionParams
from vllm.v1.core.sched.utils import check_sequence_repetition

SETTINGS = [(8, 6), (16, 4), (24, 3), (48, 4)]


def texts(files, column):
    return [t for f in files for t in pq.read_table(f, columns=[column]).column(0).to_pylist()]


def main():
    run = Path(sys.argv[1])
    model = sys.argv[2] if len(sys.argv) > 2 else str(Path.home() / ".cache/batchjson/smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(model)
    failed = [*(run / "_batchjson" / "requeue").glob("*.parquet"), *(run / "_rejects").glob("p1-*.parquet")]
    loops = [tok(t, add_special_tokens=False)["input_ids"] for t in texts(failed, "raw_text")]
    valid = [tok(t, add_special_tokens=False)["input_ids"] for t in texts(run.glob("p*.parquet"), "json")]
    print(f"{len(loops)} failed pass-1 rows, {len(valid)} valid rows")
    for max_pattern, min_count in SETTINGS:
        params = RepetitionDetectionParams(max_pattern_size=max_pattern, min_count=min_count)

        def stop_at(ids):
            return next((n for n in range(1, len(ids) + 1) if check_sequence_repetition(ids[:n], params)), None)

        caught = [n for n in map(stop_at, loops) if n]
        hits = sum(stop_at(ids) is not None for ids in valid)
        print(f"max_pattern_size={max_pattern} min_count={min_count}: stops {len(caught)}/{len(loops)} failed rows "
              f"(mean at token {sum(caught) / max(1, len(caught)):.0f}); would stop {hits}/{len(valid)} valid rows")


if __name__ == "__main__":
    main()
