#!/bin/bash
# One profiling session on a two-GPU host (after the bundle is installed, and
#   export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1):
#   bash bench/gpu/profile_session.sh OUT_DIR [BUDGET_S]
# PLAN=profile (the default):
#   GPU 0: SmolLM2, task A: none, ngram k=4, suffix k=8, one after the other.
#   GPU 1, meanwhile: the Llama-3-8B shape (random weights, SmolLM2's tokenizer): none, ngram k=4, draft_model k=4.
# PLAN=tasks: the same two SmolLM2 runs on each GPU, task TASK0 (B) on GPU 0 and TASK1 (C) on GPU 1: none and
#   suffix k=8.
# Each bench/spec_profile.py call runs under its own `timeout` (a share of BUDGET_S, default 480), writes
# OUT_DIR/<name>.json and OUT_DIR/<name>.log (stderr); at the end a table of every JSON, the errors the profile
# files recorded, and the tail of each failed log.
# Environment (for a CPU smoke test): MODEL (/tmp/models/smollm2), SIZES (1,8,32,128,512), SIZES_8B (1,8,32,128),
# WAVES (2), MAX_TOKENS (256), TASK (A), SKIP_8B=1 (no GPU-1 part), GPU0/GPU1 (0/1: CUDA_VISIBLE_DEVICES; empty:
# leave it alone), PYTHON (python3), EXTRA (more spec_profile arguments, e.g. --engine '{"max_model_len": 2048}').
set -u
out=${1:?usage: profile_session.sh OUT_DIR [BUDGET_S]}
budget=${2:-480}
MODEL=${MODEL:-/tmp/models/smollm2}
SIZES=${SIZES:-1,8,32,128,512}
SIZES_8B=${SIZES_8B:-1,8,32,128}
WAVES=${WAVES:-2}
MAX_TOKENS=${MAX_TOKENS:-256}
TASK=${TASK:-A}
PLAN=${PLAN:-profile}
TASK0=${TASK0:-B}
TASK1=${TASK1:-C}
SKIP_8B=${SKIP_8B:-0}
GPU0=${GPU0-0}
GPU1=${GPU1-1}
EXTRA=${EXTRA:-}
here=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
start=$(date +%s)

# name, then spec_profile arguments; the time limit is this call's share of what is left of the budget
# ($remaining runs left in the lane, the last one gets all that is left, at least 30 s).
run_one() {
    local gpu=$1 remaining=$2 name=$3; shift 3
    local left=$(( budget - ($(date +%s) - start) ))
    local limit=$(( left / remaining )); [ "$limit" -lt 30 ] && limit=30
    echo "[$(date +%T)] $name: GPU ${gpu:-(unset)}, timeout ${limit}s" >&2
    ( [ -n "$gpu" ] && export CUDA_VISIBLE_DEVICES=$gpu
      eval "exec timeout -k 10 $limit ${PYTHON:-python3} '$here/bench/spec_profile.py' \"\$@\" $EXTRA --task ${task:-$TASK} \
          --waves $WAVES --max-tokens $MAX_TOKENS --out '$out/$name.json'" ) > "$out/$name.stdout" 2> "$out/$name.log"
    local rc=$?
    echo "$rc" > "$out/$name.rc"
    echo "[$(date +%T)] $name: exit $rc" >&2
}

lane0() {
    run_one "$GPU0" 3 smollm2-none --model "$MODEL" --method none --in-flight "$SIZES"
    run_one "$GPU0" 2 smollm2-ngram4 --model "$MODEL" --method ngram --k 4 --in-flight "$SIZES"
    run_one "$GPU0" 1 smollm2-suffix8 --model "$MODEL" --method suffix --k 8 --in-flight "$SIZES"
}
lane1() {
    run_one "$GPU1" 3 8b-none --model "$MODEL" --shape llama-8b --method none --in-flight "$SIZES_8B"
    run_one "$GPU1" 2 8b-ngram4 --model "$MODEL" --shape llama-8b --method ngram --k 4 --in-flight "$SIZES_8B"
    run_one "$GPU1" 1 8b-draft4 --model "$MODEL" --shape llama-8b --method draft_model --draft-model "$MODEL" --k 4 \
        --in-flight "$SIZES_8B"
}

tasks_lane() {
    local gpu=$1 task=$2
    run_one "$gpu" 2 "$task-none" --model "$MODEL" --method none --in-flight "$SIZES"
    run_one "$gpu" 1 "$task-suffix8" --model "$MODEL" --method suffix --k 8 --in-flight "$SIZES"
}
if [ "$PLAN" = tasks ]; then
    lane0() { tasks_lane "$GPU0" "$TASK0"; }
    lane1() { tasks_lane "$GPU1" "$TASK1"; }
fi

lane0 & p0=$!
if [ "$SKIP_8B" != 1 ]; then lane1 & p1=$!; fi
wait $p0; [ "$SKIP_8B" != 1 ] && wait $p1
echo "[$(date +%T)] session done in $(( $(date +%s) - start ))s" >&2

${PYTHON:-python3} - "$out" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
cols = ("run", "method", "shape", "infl", "tok/s", "acc", "tok/step", "ms/step", "top parts ms/step")
rows, notes = [], []
for rc_file in sorted(out.glob("*.rc")):
    name = rc_file.stem
    rc = rc_file.read_text().strip()
    js = out / f"{name}.json"
    data = json.loads(js.read_text()) if js.exists() else {}
    for s in data.get("sizes", []):
        top = sorted(s["parts_ms_per_step"].items(), key=lambda kv: -kv[1])[:4]
        rows.append((name, f"{s['method']}{s['k'] or ''}",
                     s["shape"] or "-", str(s["in_flight"]), f"{s['output_tokens_per_s']:.0f}",
                     "-" if s["acceptance"] is None else f"{s['acceptance']:.2f}", f"{s['tokens_per_step']:.2f}",
                     f"{s['ms_per_step']:.2f}", " ".join(f"{k}={v:.2f}" for k, v in top)))
    for e in data.get("profile_errors", []):
        notes.append(f"{name}: profile error: {e}")
    if data.get("error"):
        notes.append(f"{name}: error: {data['error']}")
    skipped = {k: v for k, v in data.get("patches", {}).items() if not v.startswith("ok")}
    if data and not any(v.startswith("ok") for k, v in data.get("patches", {}).items() if "worker" in k):
        notes.append(f"{name}: no model-runner part patched: {skipped}")
    if rc != "0" or not data.get("sizes"):
        log = (out / f"{name}.log").read_text(errors="replace").splitlines()[-20:]
        notes.append(f"{name}: exit {rc}{' (timeout)' if rc in ('124', '137') else ''}; last log lines:\n    "
                     + "\n    ".join(log))
widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
for r in rows:
    print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
for n in notes:
    print(n)
PY
