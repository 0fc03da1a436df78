#!/bin/bash
# Whole runs on a GPU host (after unpack.sh), detached so that plans run while the next files are still coming:
#   setsid nohup bash bench/gpu/qwen_session.sh PLAN BUDGET_S >/dev/null 2>&1 &
#   bash bench/gpu/qwen_session.sh collect OUT_DIR          # results so far, as one archive (at most every 10 s)
# Each plan waits for the models it needs (/tmp/res/ready-<model>, written by `convert` below), then runs its
# whole_runs calls; plans run one at a time (a lock), each run in its own process, each table within one call.
#   bash bench/gpu/qwen_session.sh site                      # unpack.sh's packages + the plugin's entry point
#   bash bench/gpu/qwen_session.sh convert q15|q05|smol      # (after site) unpack.sh's conversion, then the ready mark
#   bash bench/gpu/qwen_session.sh wait SECONDS OUT_DIR      # until every plan is done or SECONDS pass; then collect
# PLAN small: SmolLM2-135M, the 600-row small job, ABAB against bare vLLM (warm compile caches for both).
# PLAN target: the 1.5B target, task C, 6,000 rows: the default against bare vLLM, both warm (the first default run
#   with its main thread's stack sampled: bench/start_trace.py).
# PLAN inflight: the 1.5B at 16 requests in flight: none / suffix / ngram, bare vLLM then batchjson (which finds the
#   compile cache bare filled for the same configuration); inflightdraft: none and the 0.5B draft model.
# PLAN pass2: what the 0.5B drafter costs pass 2's requests (no drafts) on the 1.5B: every row goes to pass 2.
# PLAN t30k: the 1.5B, 30,000 rows of task C, the default against bare vLLM, and the schema drafter.
# PLAN replicas: 2 then 1 engine replicas on one GPU (model.replicas_per_gpu), SmolLM2, 30,000 rows (2 first: the
#   first batchjson start after a bare warm-up is the slowest, so that penalty falls on the shared GPU); replicasmore:
#   3 then 2 after a warm-up; smolmore: bare vLLM's one engine (500 s: run14's 300 s were too few) and 3 (the
#   default) after a warm-up; smolrpg: 4 and 3; replicas15: the 1.5B with 2 and 1, twice; replicas05: the
#   0.5B with 1, 2 and 3 (after a warm-up of batchjson's configuration).
# PLAN inflight64: the 1.5B at 64 requests in flight, none and suffix, bare vLLM then batchjson.
# PLAN inflightngram: batchjson's n-gram lookup at 16 in flight beside bare's (run10 lost it).
# PLAN gpussmol, gpus15 (a multi-GPU host): SmolLM2 / the 1.5B, 60,000 rows, on every GPU of the host, on 2 of 4,
#   on 1 (whole_runs' +gpusN); SmolLM2 also with one replica per GPU on every GPU.
# PLAN smolmps: SmolLM2, 30,000 rows, 3 replicas on one GPU without CUDA MPS, then 3 and 4 under MPS; mpson: only
#   the MPS half (after smolall, in the same sitting).
# PLAN smolall: SmolLM2, 30,000 rows, bare vLLM's one engine and batchjson at 1, 3, 2 and 4 replicas, in one sitting.
# PLAN startkv: one engine at 0.9 of the GPU (vLLM's default) against one at 0.3, SmolLM2 and the 0.5B, 6,000 rows,
#   ABAB after a warm-up of each: run15's lone engines started 16-30 s slower than each of three replicas at 0.3.
# PLAN gap15 (run18): the 1.5B, 6,000 rows: batchjson's whole run against bare vLLM's (run17: 86.8 s against 72.4):
#   a warm-up, bare and the default, the default with vLLM's stats on (as before 2026-12), both under py-spy; bench
#   grammar's batch fills with and without stats; then the 30,000-row pair.
# PLAN schema15: batchjson's schema drafter on the 1.5B (task C, 6,000 rows): the step with it, with n-gram lookup and
#   with none and with no grammar (bench grammar, batchjson's fills), then whole runs: none, schema, bare vLLM with and without it.
#   schemasmol: the same whole runs on SmolLM2 at 30,000 rows.
# PLAN schemaprof: why batchjson's whole run with the schema drafter gained nothing where bare generate gained x1.33
#   (run19): the step with the masks placed on the GPU (bench grammar, drafts and none), then whole runs of none and
#   schema with the step profiler, after warm-ups of both.
# PLAN schemaspy: where batchjson's 6,000-row decode window goes outside the engine's steps with the schema drafts
#   (run21: 6.1 s against 3.7 without): both runs with the front end's and the engine's stacks sampled.
# PLAN schemaab: none and schema alternating, bare vLLM between them, after schemaprof's warm-ups (run20).
# PLAN schemap2: what the schema engine costs requests that opt out of drafts (schema+p2 against none+p2, 6,000 rows).
# PLAN ahead15 (issue 46): the 1.5B's step with the grammars' work beside the forward's launch (GrammarAhead) against
#   the batch fills at the step and no grammar, twice, and with the schema drafts (one step at a time, the drafted
#   positions' fills beside the launch), with 4 fill threads (run17's fills on a thread slowed the launch beside 8);
#   then the default with and without it against bare vLLM
#   (off by default until this plan has measured it); ahead15s: the step twice each way, then the default with and without;
#   smolahead, ahead15xs: the step alone, SmolLM2's then the 1.5B's.
# PLAN smollate, ahead15late (issue 46): SmolLM2's step with GrammarAhead taking step n's tokens beside n+1's launch
#   and when update_from_output asks (late); the 1.5B's with it, with 4 fill threads, and without; ahead15w: the
#   1.5B's whole runs with and without it against bare vLLM (ahead15ws: one of each); smollean: SmolLM2's step with
#   it and without, twice, and no grammar (a short sitting);
#   ahead15schema: the drafted step (schema drafts) with its fills beside the launch against at the step;
#   ahead15spy: batch, free and ahead with the engine's threads sampled, waiting ones and native frames too (py-spy
#   --idle --native --threads).
# PLAN next46 (issue 46, one 1.5B sitting, after run26): vLLM 0.26 captures CUDA graphs for steps of up to 512 tokens,
#   so at its full batch every forward runs kernel by kernel from Python (py-spy, run26): the step with GrammarAhead,
#   with no grammar at each row's own length (free) and at the mean (free+mean, run26's baseline), both with graphs
#   up to 2,048 tokens (+cg2048), and the batch fills; then whole runs of the default with and without those graphs
#   against bare vLLM. graphssmol: SmolLM2's step with and without those graphs (a short sitting).
# PLAN next47 (issues 46 and 40, one 1.5B sitting, after run28 made graphs to 2,048 tokens the GPU default without
#   drafts): the drafted step (schema drafts, ~4,400 tokens a step) with graphs to 4,608 tokens against vLLM's, beside
#   the plain step with graphs; whole runs at 6,000 rows of the default against vLLM's graphs (+cg512) and bare vLLM,
#   one under bench/start_trace.py (run28's first request came 6-9 s after bare's); then 30,000 rows, default and bare.
# (next48 ran as run29: the thread polling the tokens' copy (+poll) gained nothing and is gone; the engine core's
#   collections at a threshold of 10,000 are the GPU default since.)
# PLAN next49 (issues 46 and 40): the step with the collections' default against the interpreter's (+gc700),
#   alternating, beside no grammar; whole runs at 6,000 rows, the default and bare vLLM alternating, both warm;
#   then the drafted step with graphs to 4,608 tokens against vLLM's graphs, a step without drafts between them.
# (next50 ran as run31: the switch interval (+swN) and Model Runner V2's mask rows by numpy (+rows) gained nothing and
#  are gone; py-spy sampled nothing on that host.)
# PLAN next50 (issue 46, after run30: the grammar adds 7-13 ms a step, +4 of it in the launch beside GrammarAhead's
#   thread): the step with the engine core's switch interval at 500 and 200 µs (+swN) against the interpreter's
#   5,000, alternating, beside no grammar, and Model Runner V2's mask rows mapped by numpy (+rows: sampling took 3.1
#   ms with the grammar against 1.3 without); then no grammar and the default with the engine's threads sampled
#   (py-spy --idle --native), for where the main thread waits (the interpreter's lock, or a CUDA event).
# (s16 ran as run32: its first config's 100 s ran out in the host's first compile; 180 s since.)
# PLAN s16 (issue 40: where the schema drafts might pay): the schema drafts against none at 16 in flight, alternating,
#   with suffix decoding (auto's choice there) between them. s64: the schema drafts against none at 64.
# PLAN s16w (issue 40): whole runs at 16 in flight ([model.engine] max_num_seqs = 16): none, the schema drafts,
#   suffix decoding and the default (auto), none again.
# PLAN w30k (issue 46's 0.7x at 30,000 rows, today's defaults): the default against warm bare vLLM, the default twice.
# PLAN smolgc (issue 46): SmolLM2's step with the collections' default against the interpreter's, with graphs to
#   2,048 tokens and with vLLM's, beside no grammar.
# PLAN smol46: SmolLM2's step (vLLM's fills, batchjson's, no grammar), then the default against bare vLLM at 30,000 rows.
# PLAN replicas15mps: the 1.5B with 2 replicas against 1, warm, then both under CUDA MPS.
# PLAN replicas15ab: the 1.5B at 30,000 rows, all warm, one call: 2 replicas against 1 and bare vLLM's one engine
#   (issue 46's 0.7x of bare at 30,000 rows), then 2 and 1 under CUDA MPS.
# PLAN default30k: issue 46's 0.7x at 30,000 rows in one call: the default (two replicas of the 1.5B since run22)
#   and bare vLLM alternating, both warm (the 64-row warm-up of two replicas fills their compile cache).
# PLAN kvkept15: the 1.5B at 30,000 rows: the default (two replicas) whose engines start side by side with the KV
#   cache size kept from the warm-up's start, against the same with an empty cache (+measure: one after another), bare
#   vLLM between them; then three replicas, side by side.
# PLAN smolstart: warm engine starts of SmolLM2 with and without the schema drafter, vLLM's INFO log kept.
# PLAN t15kab: schema and none alternating at 15,000 rows (where the drafts start to pay, between 6,000 and 30,000).
# PLAN advance15 (issue 46): the grammars' advance in update_from_output on vLLM 0.26 and the host's cores: bench
#   grammar --matchers (vLLM's call per request against one batch call, no engine: advance_* columns), then the step
#   with vLLM's fills, batchjson's and no grammar, whose profile times that advance inside update_from_output.
# PLAN grammar15: what the JSON constraint costs the 1.5B's step (bench grammar): xgrammar alone on the host's cores,
#   then bare vLLM at 1,024 in flight with vLLM's mask fills, batchjson's, and no grammar (py-spy on each).
# PLAN fills15: the 1.5B's step with vLLM's fills, batchjson's and no grammar (bench grammar), whole runs of the
#   default against bare vLLM and against grammar_fills = "vllm", then n-gram k 4 with each fill and vLLM's fills
#   again (how many rows differ between two runs of the same configuration).
# PLANS v34probe v34smol v34step v34w30k v34seqs (vLLM 0.34.0 over the host's torch): the sample job on SmolLM2 (its
#   report lists the patches on), SmolLM2 at 30,000 rows against bare vLLM; the 1.5B's step at 1,024 in flight with
#   vLLM's fills, batchjson's, none and each drafter; the 1.5B's default at 30,000 rows against bare vLLM, twice; the
#   drafters against none at 64, 16 and 256 in flight.
# PLANS v34av v34avdraft v34av256 v34avw (issue 68, vLLM 0.34): the drafters with 2, 4 and 8 drafts a request
#   against none at 1,024, 64, 16 and 256 in flight; the 0.5B draft model; whole runs at 30,000 rows.
# PLAN v34ahead (issue 68, vLLM 0.34): the grammars' work beside the forward's launch with drafts ahead of time, none,
#   suffix and the schema drafter at 1,024 and 64 in flight; v34aheadsmol: the same on SmolLM2 at 1,024.
# PLAN all: the plans named in PLANS (default: what run15 left: startkv smolmps replicas15; SmolLM2's first, as its
#   files come first) in that order, within BUDGET_S.
set -u
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PATH=/tmp/spy/bin:$PATH
res=/tmp/res
mkdir -p $res
case "$1" in
  collect)
    out=$2
    while :; do
      tar -czf $out/.res.tgz -C /tmp res 2>/dev/null && mv $out/.res.tgz $out/res.tgz
      [ -f $res/done-all ] && break
      sleep 10
    done
    exit 0 ;;
  site)
    { /usr/bin/time -f "site: %e s" bash bench/gpu/unpack.sh site && bash bench/gpu/register_plugin.sh /tmp/site \
        && touch $res/ready-site; } >> $res/site.log 2>&1
    exit 0 ;;
  convert)
    while [ ! -f $res/ready-site ]; do sleep 1; done
    { /usr/bin/time -f "convert $2: %e s" bash bench/gpu/unpack.sh $2 && touch $res/ready-$2; } >> $res/convert-$2.log 2>&1
    exit 0 ;;
  wait)
    end=$(( $(date +%s) + $2 ))
    while [ ! -f $res/done-all ] && [ "$(date +%s)" -lt $end ]; do sleep 5; done
    tar -czf $3/res.tgz -C /tmp res
    tail -n 30 $res/session.log; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
    exit 0 ;;
esac
plan=$1 budget=${2:-600}
# Plans run from a snapshot of the project: each transfer replaces the project's copy on the host, and a run that
# imports a module while that happens fails (run34: "No module named 'batchjson.deadline'").
if [ "${QWEN_SNAPSHOT:-}" != 1 ]; then
  tree=$(mktemp -d /tmp/tree.XXXX)
  tar -c --exclude=./.dev --exclude=./.venv --exclude=./.git . | tar -x -C $tree
  cd $tree && export PYTHONPATH=/tmp/site:$PWD QWEN_SNAPSHOT=1 && exec bash bench/gpu/qwen_session.sh "$@"
fi
start=$(date +%s)
exec 9>/tmp/gpu.lock; flock 9
left() { echo $(( budget - ($(date +%s) - start) )); }
need() { while [ ! -f $res/ready-$1 ]; do [ "$(left)" -lt 60 ] && return 1; sleep 2; done; return 0; }
wr() {  # name, then whole_runs arguments
  local name=$1; shift
  local b=$(left); [ "$b" -lt 60 ] && return
  echo "[$(date +%T)] $name (budget ${b}s)" >> $res/session.log
  python3 bench/whole_runs.py --out $res/$name --work /tmp/wr/$name --budget $b "$@" > $res/$name.log 2>&1
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader >> $res/session.log
}
gb() {  # name, then `python -m bench grammar` arguments
  local name=$1; shift
  local b=$(left); [ "$b" -lt 60 ] && return
  echo "[$(date +%T)] $name (budget ${b}s)" >> $res/session.log
  python3 -m bench grammar --out $res/$name --budget $b "$@" > $res/$name.log 2>&1
  tail -n 12 $res/$name.log >> $res/session.log
}
smol=/tmp/models/smollm2 q05=/tmp/models/coder-0.5b q15=/tmp/models/coder-1.5b
gpu_runs() {  # every GPU of the host (its chosen replicas per GPU; also 1 per GPU with rpg1), 2 of 4, then 1
  local n=$(nvidia-smi -L | grep -c '^GPU') runs
  runs="none+gpus$n"
  [ "${1:-}" = rpg1 ] && runs="$runs,none+rpg1+gpus$n"
  [ "$n" -gt 2 ] && runs="$runs,none+gpus2"
  echo "$runs,none+gpus1"
}
mps() {  # CUDA MPS: the replicas' kernels share the GPU at once instead of taking turns (not measured before)
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
  if [ "$1" = stop ]; then
    echo quit | nvidia-cuda-mps-control 2>/dev/null; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; return 0
  fi
  command -v nvidia-cuda-mps-control >/dev/null || { echo "no nvidia-cuda-mps-control" >> $res/session.log; return 1; }
  mkdir -p /tmp/mps/pipe /tmp/mps/log && nvidia-cuda-mps-control -d && echo "[$(date +%T)] MPS on" >> $res/session.log
}
run_plan() {
  case $1 in
    v34probe) need site && { python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__); \
import vllm._C_stable_libtorch; print('ops ok')"; python3 -m batchjson check jobs/sample.toml; } >> $res/v34probe.log 2>&1
              need smol && sed "s#^path = \"default\"#path = \"$smol\"#" jobs/sample.toml > jobs/.gpu-sample.toml \
                && timeout 400 python3 -m batchjson run jobs/.gpu-sample.toml --output /tmp/out/sample \
                   >> $res/v34probe.log 2>&1; cp /tmp/out/sample/_report.json $res/v34-sample-report.json 2>/dev/null
              echo "[$(date +%T)] v34probe rc=$?" >> $res/session.log; tail -n 25 $res/v34probe.log >> $res/session.log ;;
    v34smol) need smol && wr v34-smol-C30000 --task C --rows 30000 --model $smol --timeout 300 \
               --runs warm-none,bare-none,auto ;;
    v34step) need q15 && gb v34-g15-C6000 --task C --rows 6000 --model $q15 --seqs 1024 \
               --configs vllm,ahead,free,ahead-suffix,ahead-schema,ahead-ngram --timeout 200 ;;
    v34w30k) need q15 && wr v34-t15-C30000 --task C --rows 30000 --model $q15 --timeout 300 \
               --runs bare-none,auto ;;
    v34seqs) need q15 && gb v34-g15-C1500-64 --task C --rows 1500 --model $q15 --seqs 64 \
               --configs ahead,ahead-suffix,ahead-schema,ahead-ngram --timeout 150
             need q15 && gb v34-g15-C480-16 --task C --rows 480 --model $q15 --seqs 16 \
               --configs ahead,ahead-suffix,ahead-schema,ahead-ngram --timeout 150
             need q15 && gb v34-g15-C3000-256 --task C --rows 3000 --model $q15 --seqs 256 \
               --configs ahead,ahead-suffix,ahead-schema --timeout 150 ;;
    # issue 68 on vLLM 0.34: how many drafts a request pay, by requests in flight (run34: at 1,024 suffix k 2 gained
    # x1.14 where k 8 lost, adaptive verification (+av) lost at both), none with batchjson's graphs (+cg2048) beside
    # vLLM's; then whole runs of the 1.5B at 30,000 rows: speculation off, suffix and schema, and the default
    v34av) need q15 && gb v34av-g15-C6000 --task C --rows 6000 --model $q15 --seqs 1024 --draft $q05 \
             --configs ahead,ahead+cg2048,ahead-suffix+k2,ahead-suffix+k4,ahead-schema+k2,ahead-schema+k4 --timeout 200
           need q15 && gb v34av-g15-C1500-64 --task C --rows 1500 --model $q15 --seqs 64 --draft $q05 \
             --configs ahead,ahead-suffix,ahead-suffix+k4,ahead-schema+k4,ahead-ngram --timeout 150
           need q15 && gb v34av-g15-C480-16 --task C --rows 480 --model $q15 --seqs 16 --draft $q05 \
             --configs ahead,ahead-suffix,ahead-schema --timeout 150 ;;
    v34avdraft) need q15 && need q05 && gb v34av-g15-C1500-64d --task C --rows 1500 --model $q15 --seqs 64 \
             --draft $q05 --configs ahead,ahead-draft,ahead-draft+k2 --timeout 200
           need q15 && need q05 && gb v34av-g15-C6000d --task C --rows 6000 --model $q15 --seqs 1024 \
             --draft $q05 --configs ahead,ahead-draft+k2 --timeout 200 ;;
    v34av256) need q15 && gb v34av-g15-C3000-256 --task C --rows 3000 --model $q15 --seqs 256 \
             --configs ahead,ahead-suffix+k2,ahead-suffix+k4,ahead-schema+k4 --timeout 150 ;;
    # issue 68: GrammarAhead with drafts ahead of time (vLLM 0.34; "batch" keeps the drafted step's grammar work at
    # the step, as run34 measured it): none, suffix and the schema drafter at 1,024 in flight, then 64
    v34ahead) need q15 && gb v34ahead-g15-C6000 --task C --rows 6000 --model $q15 --seqs 1024 \
             --configs ahead,ahead-suffix+k2,batch-suffix+k2,ahead-schema+k2,ahead-suffix+k4 --timeout 200
           need q15 && gb v34ahead-g15-C1500-64 --task C --rows 1500 --model $q15 --seqs 64 \
             --configs ahead,ahead-suffix+k4,ahead-schema+k4 --timeout 150 ;;
    v34aheadsmol) need smol && gb v34ahead-smol-C6000 --task C --rows 6000 --model $smol --seqs 1024 \
             --configs ahead-suffix+k2,batch-suffix+k2,ahead,ahead-schema+k2 --timeout 150 ;;
    v34avw) need q15 && wr v34av-t15-C30000 --task C --rows 30000 --model $q15 --timeout 300 \
             --runs none,suffix,auto,schema ;;
    small) need smol && wr smol-C600 --task C --rows 600 --model $smol --timeout 120 \
             --runs warm-none,auto,bare-none,auto,bare-none ;;
    target) need q15 && wr t15-C6000 --task C --rows 6000 --model $q15 --timeout 200 \
             --runs warm-none,auto+trace,bare-none,auto ;;
    inflight) need q15 && wr t15-C320-16 --task C --rows 320 --model $q15 --timeout 150 \
             --runs bare-none@16,none@16,bare-suffix@16,suffix@16,bare-ngram@16,ngram@16 ;;
    inflightngram) need q15 && wr t15-C320-16n --task C --rows 320 --model $q15 --timeout 150 \
             --runs bare-ngram@16,ngram@16 ;;
    inflightdraft) need q15 && need q05 && wr t15-C320-16d --task C --rows 320 --model $q15 --draft $q05 \
             --timeout 150 --runs bare-none@16,none@16,bare-draft@16,draft@16 ;;
    pass2) need q15 && need q05 && wr t15-C1000-p2 --task C --rows 1000 --model $q15 --draft $q05 --timeout 200 \
             --runs none+p2-noadapt,draft+p2-noadapt ;;
    replicas) need smol && wr rpg-smol-C30000 --task C --rows 30000 --model $smol --timeout 300 \
             --runs warm-none,none+rpg2+warm,none+rpg2,none+rpg1 ;;
    replicasmore) need smol && wr rpg-smol-C30000-more --task C --rows 30000 --model $smol --timeout 300 \
             --runs warm-none,none+rpg3,none+rpg2 ;;
    smolmore) need smol && wr rpg-smol-C30000-bare --task C --rows 30000 --model $smol --timeout 500 \
             --runs warm-none,bare-none,none+rpg3 ;;
    smolrpg) need smol && wr rpg-smol-C30000-34 --task C --rows 30000 --model $smol --timeout 300 \
             --runs none+rpg4,none+rpg3 ;;
    replicas05) need q05 && wr rpg-q05-C30000 --task C --rows 30000 --model $q05 --timeout 300 \
             --runs none+rpg2+warm,none+rpg1,none+rpg2,none+rpg3 ;;
    smolall) need smol && wr rpg-smol-C30000-all --task C --rows 30000 --model $smol --timeout 400 \
             --runs warm-none,none+rpg3+warm,bare-none,none+rpg1,none+rpg3,none+rpg2,none+rpg4 ;;
    replicas15) need q15 && wr rpg-t15-C30000 --task C --rows 30000 --model $q15 --timeout 300 \
             --runs none+rpg1+warm,none+rpg2+log,none+rpg1,none+rpg2 ;;
    inflight64) need q15 && wr t15-C1000-64 --task C --rows 1000 --model $q15 --timeout 150 \
             --runs bare-none@64,none@64,bare-suffix@64,suffix@64 ;;
    gpussmol) need smol && wr gpus-smol-C60000 --task C --rows 60000 --model $smol --timeout 500 \
             --runs warm-none,$(gpu_runs rpg1) ;;
    gpus15) need q15 && wr gpus-t15-C60000 --task C --rows 60000 --model $q15 --timeout 500 \
             --runs warm-none,$(gpu_runs) ;;
    smolmps) need smol && wr mps-off-smol-C30000 --task C --rows 30000 --model $smol --timeout 300 \
             --runs warm-none,none+rpg3+warm,none+rpg3 \
             && mps start && wr mps-on-smol-C30000 --task C --rows 30000 --model $smol --timeout 300 \
             --runs none+rpg3,none+rpg4; mps stop ;;
    mpson) need smol && mps start && wr mps-on-smol-C30000 --task C --rows 30000 --model $smol --timeout 300 \
             --runs none+rpg3,none+rpg4; mps stop ;;
    startkv) local ab=none+rpg1,none+gmu0.3+rpg1
             need smol && wr startkv-smol-C6000 --task C --rows 6000 --model $smol --timeout 200 \
               --runs none+rpg1+warm,none+gmu0.3+rpg1+warm,$ab,$ab
             need q05 && wr startkv-q05-C6000 --task C --rows 6000 --model $q05 --timeout 200 \
               --runs none+rpg1+warm,none+gmu0.3+rpg1+warm,$ab,$ab ;;
    grammar15) need q15 && gb g15-matchers --matchers $q15 --task C --seqs 256,1024 --threads 8
             need q15 && gb g15-C6000 --task C --rows 6000 --model $q15 --seqs 1024 --configs vllm,batch,free \
               --pyspy 6 --timeout 200 ;;
    fills15) need q15 && gb g15-C6000-fills --task C --rows 6000 --model $q15 --seqs 1024 --configs vllm,batch,free \
               --timeout 200
             need q15 && wr t15-C6000-fills --task C --rows 6000 --model $q15 --timeout 200 \
               --runs auto+warm,bare-none,auto,auto-nofills
             need q15 && gb g15-C6000-ngram --task C --rows 6000 --model $q15 --seqs 1024 \
               --configs vllm-ngram,batch-ngram,vllm --timeout 200 ;;
    gap15) need q15 && wr t15-C6000-gap --task C --rows 6000 --model $q15 --timeout 200 \
             --runs auto+warm,bare-none,auto,auto+stats,auto+spy,bare-none+spy
           need q15 && gb g15-C6000-stats --task C --rows 6000 --model $q15 --seqs 1024 --configs batch,batch+stats \
             --timeout 200
           need q15 && wr t15-C30000 --task C --rows 30000 --model $q15 --timeout 300 --runs bare-none,auto,schema ;;
    schema15) need q15 && gb g15-C6000-schema --task C --rows 6000 --model $q15 --seqs 1024 \
                --configs batch,free,batch-schema,batch-ngram --timeout 200
              need q15 && wr t15-C6000-schema --task C --rows 6000 --model $q15 --timeout 200 \
                --runs schema+warm,none+warm,bare-none,none,schema,bare-schema ;;
    schemasmol) need smol && wr smol-C30000-schema --task C --rows 30000 --model $smol --timeout 300 \
                --runs schema+warm,none,schema ;;
    schemaprof) need q15 && gb g15-C6000-schemaprof --task C --rows 6000 --model $q15 --seqs 1024 \
                  --configs batch,batch-schema --timeout 200
                need q15 && wr t15-C6000-schemaprof --task C --rows 6000 --model $q15 --timeout 200 \
                  --runs schema+warm,none+warm,none+prof,schema+prof,schema ;;
    schemaspy) need q15 && wr t15-C6000-spy --task C --rows 6000 --model $q15 --timeout 200 \
                 --runs schema+warm,none+warm,none+spy,schema+spy ;;
    schemaab) need q15 && wr t15-C6000-ab --task C --rows 6000 --model $q15 --timeout 150 \
                --runs none,schema,bare-none,none,schema ;;
    advance15) need q15 && gb g15-advance --matchers $q15 --task C --seqs 256,1024 --threads 8
               need q15 && gb g15-C6000-advance --task C --rows 6000 --model $q15 --seqs 1024 \
                 --configs batch,free,vllm --timeout 200 ;;
    t30k) need q15 && wr t15-C30000 --task C --rows 30000 --model $q15 --timeout 300 --runs bare-none,auto,schema ;;
    # where the schema drafts cannot help (one free-text field): forced on, against none (issue 40's no-regression)
    freetext) need q15 && wr t15-D6000-schema --task D --rows 6000 --model $q15 --timeout 200 \
                --runs schema+warm,none,schema,none ;;
    # both orders in one call: run21's default ran first after bare vLLM, where batchjson's start was slowest before
    t30kab) need q15 && wr t15-C30000-ab --task C --rows 30000 --model $q15 --timeout 300 \
              --runs schema+log,auto+log,bare-none,auto,schema ;;
    # what the schema engine costs requests that opt out of drafts (pass 2 on pass 1's engine), against none's engine;
    # then the drafts' break-even size between 6,000 and 30,000 rows
    schemap2) need q15 && wr t15-C6000-p2 --task C --rows 6000 --model $q15 --timeout 200 \
                --runs schema+p2-noadapt,none+p2-noadapt,schema+p2-noadapt,none+p2-noadapt ;;
    t15kab) need q15 && wr t15-C15000-ab --task C --rows 15000 --model $q15 --timeout 250 --runs schema,none,schema,none ;;
    # SmolLM2 (issue 46): its step with vLLM's fills, batchjson's and no grammar at a full batch, then the default
    # against bare vLLM at 30,000 rows
    smol46) need smol && gb s-C6000-fills --task C --rows 6000 --model $smol --seqs 1024 --configs vllm,batch,ahead,free \
              --timeout 200
            need smol && wr smol-C30000-46 --task C --rows 30000 --model $smol --timeout 400 \
              --runs auto+log,bare-none ;;
    # the 1.5B's two replicas, warm, without and with CUDA MPS (run14's 2 replicas, cold, decoded at about half one
    # engine's rows/s while both ran: the engines' kernels taking turns on the GPU is the suspect)
    replicas15mps) need q15 && wr rpg-t15-C30000-mps-off --task C --rows 30000 --model $q15 --timeout 300 \
                     --runs none+rpg1+warm,none+rpg2+warm,none+rpg2,none+rpg1 \
                   && mps start && wr rpg-t15-C30000-mps-on --task C --rows 30000 --model $q15 --timeout 300 \
                     --runs none+rpg2,none+rpg1; mps stop ;;
    replicas15ab) need q15 && wr rpg-t15-C30000-ab --task C --rows 30000 --model $q15 --timeout 300 \
                    --runs warm-none,none+rpg1+warm,none+rpg2+warm,none+rpg2,none+rpg1,bare-none \
                  && mps start && wr rpg-t15-C30000-ab-mps --task C --rows 30000 --model $q15 --timeout 300 \
                    --runs none+rpg2,none+rpg1; mps stop ;;
    kvkept15) need q15 && wr t15-C30000-kv --task C --rows 30000 --model $q15 --timeout 300 \
                --runs warm-none,auto+rpg2+warm,schema+rpg2+warm,bare-none,auto+rpg2,auto+rpg2+measure,none+rpg3+warm,none+rpg3 ;;
    default30k) need q15 && wr t15-C30000-default --task C --rows 30000 --model $q15 --timeout 300 \
                  --runs warm-none,auto+rpg2+warm,bare-none,auto,bare-none,auto ;;
    # where a drafted engine's longer start goes: vLLM's INFO log of warm starts with and without the schema drafter
    smolstart) need smol && wr smol-C64-start --task C --rows 6000 --model $smol --timeout 200 \
                 --runs schema+warm,schema+warm+log,none+warm+log ;;
    # issue 46: the grammars' work beside the forward's launch (GrammarAhead) against the batch fills at the step and
    # no grammar, two of each alternating, then the default with and without it against bare vLLM at 6,000 rows
    ahead15) need q15 && gb g15-C6000-ahead --task C --rows 6000 --model $q15 --seqs 1024 \
               --configs ahead,batch,free,ahead-schema,batch-schema,ahead@4,batch --timeout 200
             need q15 && wr t15-C6000-ahead --task C --rows 6000 --model $q15 --timeout 200 \
               --runs auto+ahead+warm,auto+warm,auto+ahead,auto,bare-none,auto+ahead,auto ;;
    # the same in a short sitting: the step twice each way and no grammar, then the default with and without it
    ahead15s) need q15 && gb g15-C6000-ahead --task C --rows 6000 --model $q15 --seqs 1024 \
               --configs ahead,batch,free,ahead,batch --timeout 200
              need q15 && wr t15-C6000-ahead --task C --rows 6000 --model $q15 --timeout 200 \
               --runs auto+ahead,auto,auto+ahead,auto ;;
    # a shorter sitting still: SmolLM2's step each way twice and no grammar, then the 1.5B's as its files come
    smolahead) need smol && gb s-C6000-ahead --task C --rows 6000 --model $smol --seqs 1024 \
                 --configs batch,ahead,free,batch,ahead --timeout 200 ;;
    ahead15xs) need q15 && gb g15-C6000-ahead --task C --rows 6000 --model $q15 --seqs 1024 \
                 --configs ahead,batch,free,ahead,batch --timeout 200 ;;
    ahead15more) need q15 && gb g15-C6000-ahead-more --task C --rows 6000 --model $q15 --seqs 1024 \
               --configs ahead,batch,ahead@2,ahead@4,vllm --timeout 200 ;;
    # SmolLM2: where the grammars take step n's tokens, beside n+1's launch (ahead, the default) or when
    # update_from_output asks (late: only the fill beside it); the 1.5B: ahead against the batch fills at the step, no
    # grammar, vLLM's own fills (the rows' reference) and ahead with 4 fill threads; then the default with and without
    # GrammarAhead against bare vLLM, and the drafted step (schema drafts, one step at a time) with its fills beside
    # the launch
    smollate) need smol && gb s-C6000-late --task C --rows 6000 --model $smol --seqs 1024 \
                --configs ahead,late,batch,late,ahead --timeout 200 ;;
    smollean) need smol && gb s-C6000-lean --task C --rows 6000 --model $smol --seqs 1024 \
                --configs ahead,batch,ahead+rows,ahead,batch,free --timeout 150 ;;
    ahead15late) need q15 && gb g15-C6000-late --task C --rows 6000 --model $q15 --seqs 1024 \
                   --configs ahead,batch,free,vllm,ahead@4,ahead+rows,ahead --timeout 200 ;;
    ahead15w) need q15 && wr t15-C6000-ahead --task C --rows 6000 --model $q15 --timeout 200 \
                --runs auto+warm,auto,auto+noahead,bare-none,auto,auto+noahead ;;
    ahead15ws) need q15 && wr t15-C6000-ahead --task C --rows 6000 --model $q15 --timeout 200 \
                 --runs auto+warm,auto,auto+noahead,bare-none ;;
    graphssmol) need smol && gb s-C6000-graphs --task C --rows 6000 --model $smol --seqs 1024 \
                  --configs ahead,ahead+cg2048,free,free+cg2048,ahead,ahead+cg2048 --timeout 150 ;;
    next46) need q15 && gb g15-C6000-next --task C --rows 6000 --model $q15 --seqs 1024 \
              --configs ahead,free,free+mean,ahead+cg2048,free+cg2048,batch --timeout 200
            need q15 && wr t15-C6000-next --task C --rows 6000 --model $q15 --timeout 200 \
              --runs auto+warm,auto+cg2048+warm,auto,auto+cg2048,bare-none ;;
    next49) need q15 && gb g15-C6000-gc --task C --rows 6000 --model $q15 --seqs 1024 --timeout 200 \
              --configs ahead+gc700+cg2048,ahead+cg2048,free+cg2048,ahead+gc700+cg2048,ahead+cg2048
            need q15 && wr t15-C6000-gc --task C --rows 6000 --model $q15 --timeout 200 \
              --runs auto+warm,bare-none,auto,bare-none,auto
            need q15 && gb g15-C6000-drafted --task C --rows 6000 --model $q15 --seqs 1024 \
              --configs ahead-schema+cg4608,ahead+cg2048,ahead-schema --timeout 200 ;;
    next50) need q15 && gb g15-C6000-sw --task C --rows 6000 --model $q15 --seqs 1024 --timeout 200 \
              --configs ahead+cg2048,ahead+sw500+cg2048,free+cg2048,ahead+sw200+cg2048,ahead+rows+cg2048,ahead+cg2048,\
ahead+sw500+cg2048
            need q15 && gb g15-C6000-spy2 --task C --rows 6000 --model $q15 --seqs 1024 --timeout 200 \
              --configs free+cg2048,ahead+cg2048 --pyspy 5 --idle --native ;;
    s16) need q15 && gb g15-C480-16-schema --task C --rows 480 --model $q15 --seqs 16 --timeout 180 \
           --configs ahead-schema,ahead,ahead-suffix,ahead-schema,ahead ;;
    s64) need q15 && gb g15-C960-64-schema --task C --rows 960 --model $q15 --seqs 64 --timeout 180 \
           --configs ahead-schema,ahead,ahead-schema,ahead ;;
    s16w) need q15 && wr t15-C960-16 --task C --rows 960 --model $q15 --timeout 150 \
            --runs none@16+warm,none@16,schema@16,suffix@16,auto@16,none@16 ;;
    w30k) need q15 && wr t15-C30000-w30k --task C --rows 30000 --model $q15 --timeout 300 \
            --runs warm-none,auto+warm,auto,bare-none,auto ;;
    smolgc) need smol && gb s-C6000-gc --task C --rows 6000 --model $smol --seqs 1024 --timeout 150 \
              --configs ahead+gc700+cg2048,ahead+cg2048,free+cg2048,ahead+gc700,ahead ;;
    next47) need q15 && gb g15-C6000-graphs --task C --rows 6000 --model $q15 --seqs 1024 \
              --configs ahead-schema+cg4608,ahead-schema,ahead+cg2048,free+cg2048 --timeout 200
            need q15 && wr t15-C6000-graphs --task C --rows 6000 --model $q15 --timeout 200 \
              --runs auto+warm,auto+cg512+warm,auto+trace,auto+cg512,bare-none,auto
            need q15 && wr t15-C30000-graphs --task C --rows 30000 --model $q15 --timeout 300 --runs auto,bare-none ;;
    # where the engine core's threads wait: py-spy on the engine process with waiting threads kept, each thread apart
    ahead15spy) need q15 && gb g15-C6000-spy --task C --rows 6000 --model $q15 --seqs 1024 --configs batch,free,ahead \
                  --pyspy 5 --idle --native --timeout 200 ;;
    ahead15schema) need q15 && gb g15-C6000-ahead-schema --task C --rows 6000 --model $q15 --seqs 1024 \
                     --configs batch-schema,ahead-schema,batch-schema,ahead-schema --timeout 200 ;;
    t30kschema) need q15 && wr t15-C30000-schema --task C --rows 30000 --model $q15 --timeout 300 --runs schema,auto ;;
  esac
}
if [ "$plan" = all ]; then
  for p in ${PLANS:-startkv smolmps replicas15}; do run_plan $p; done
else
  run_plan $plan
fi
echo "[$(date +%T)] $plan done" >> $res/session.log
touch $res/done-$plan
