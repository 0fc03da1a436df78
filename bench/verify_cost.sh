#!/bin/bash
# `batchjson verify`'s time and peak memory on a job of ROWS rows (BENCHMARKS.md, "`batchjson verify` at a million
# rows"): makes the input (4 files, ids row-000000000...) and runs the job once on the fake engine (bench/fakerun.py),
# kept in WORK for later calls; then times `batchjson verify` with the batchjson of TREE (default: this one).
#   bash bench/verify_cost.sh ROWS [TREE]          # WORK defaults to /tmp/verify-cost
set -euo pipefail
rows=$1 root="$(cd "$(dirname "$0")/.." && pwd)"
tree="$(cd "${2:-$root}" && pwd)" w="${WORK:-/tmp/verify-cost}/$rows" py="$root/.venv/bin/python"
if [ ! -f "$w/done" ]; then
  rm -rf "$w" && mkdir -p "$w"
  (cd "$root" && "$py" - "$w" "$rows" "$root" <<'PY'
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from bench.smoke import tokenizer_model

w, n, root = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
tokenizer_model(w / "model")
for k in range(4):
    part = range(k * n // 4, (k + 1) * n // 4)
    pq.write_table(pa.table({"id": [f"row-{i:09d}" for i in part], "text": [f"invoice {i}" for i in part]}),
                   w / f"in-{k}.parquet")
(w / "job.toml").write_text(f'[input]\npath = "{w}/in-*.parquet"\nid_column = "id"\n[prompt]\ntemplate = "Extract: {{text}}"\n'
                            f'[schema]\npath = "{root}/sample_data/schema.json"\n[model]\npath = "{w}/model"\n'
                            f'[output]\npath = "{w}/out"\n')
PY
  )
  (cd "$root" && BATCHJSON_BENCH_FAKE="$w/model" /usr/bin/time -f "fake run: %e s, max RSS %M KB" \
      "$py" -m bench.fakerun run "$w/job.toml" 2>&1 | tail -3)
  touch "$w/done"
fi
cd "$tree" && PYTHONPATH="$tree" /usr/bin/time -f "verify: %e s, max RSS %M KB" "$py" -m batchjson verify "$w/job.toml" 2>&1 \
    | tail -2
