#!/bin/bash
# Whole runs of the Qwen2.5-Coder models on a GPU host (after unpack.sh has converted them), detached so that a
# plan can run while the next files are still coming:
#   setsid nohup bash bench/gpu/qwen_session.sh PLAN BUDGET_S >/dev/null 2>&1 &
#   bash bench/gpu/qwen_session.sh collect OUT_DIR          # results so far, as one archive (at most every 10 s)
# PLAN small: the 0.5B as the target (no smaller draft exists): task C 6,000 rows, then 1,000 rows at 64 in flight.
# PLAN target: the 1.5B target with the 0.5B as its draft: task C 6,000 rows, 1,000 rows at 64 in flight, the hard
#   task A at 600 rows, then 30,000 rows of C. Plans run one at a time (a lock), each run in its own process
#   (bench/whole_runs.py), each table within one call of whole_runs, and each whole_runs call within the plan's budget.
set -u
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
res=/tmp/res
mkdir -p $res
if [ "$1" = collect ]; then
  out=$2
  while :; do
    tar -czf $out/.res.tgz -C /tmp res 2>/dev/null && mv $out/.res.tgz $out/res.tgz
    [ -f $res/done-target ] && break
    sleep 10
  done
  exit 0
fi
plan=$1 budget=${2:-600}
start=$(date +%s)
exec 9>/tmp/gpu.lock; flock 9
left() { echo $(( budget - ($(date +%s) - start) )); }
wr() {  # name, then whole_runs arguments
  local name=$1; shift
  local b=$(left); [ "$b" -lt 60 ] && return
  echo "[$(date +%T)] $name (budget ${b}s)" >> $res/session.log
  python3 bench/whole_runs.py --out $res/$name --work /tmp/wr/$name --budget $b "$@" > $res/$name.log 2>&1
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader >> $res/session.log
}
q05=/tmp/models/coder-0.5b q15=/tmp/models/coder-1.5b
case $plan in
  small)
    wr s05-C6000 --task C --rows 6000 --model $q05 --timeout 200 --runs warm-none,bare-none,auto,suffix,bare-suffix
    wr s05-C1000-64 --task C --rows 1000 --model $q05 --timeout 150 \
       --runs bare-none@64,none@64,bare-suffix@64,suffix@64 ;;
  target)
    wr t15-C6000 --task C --rows 6000 --model $q15 --draft $q05 --timeout 240 \
       --runs warm-none,bare-none,auto,warm-draft,bare-draft,draft,suffix
    wr t15-C1000-64 --task C --rows 1000 --model $q15 --draft $q05 --timeout 180 \
       --runs bare-none@64,bare-draft@64,none@64,draft@64
    wr t15-A600 --task A --rows 600 --model $q15 --draft $q05 --timeout 200 --runs bare-none,auto,draft
    wr t15-C30000 --task C --rows 30000 --model $q15 --draft $q05 --timeout 300 --runs bare-none,auto ;;
esac
echo "[$(date +%T)] $plan done" >> $res/session.log
touch $res/done-$plan
