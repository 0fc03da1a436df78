"""Scaling over the GPUs of one host: the same job on 1 replica, on N replicas (the default: one per GPU), and as
N static `--shard I/N` processes, with what each process and GPU was doing sampled every second.

    python -m bench replicas --task A --rows 5000 --model /tmp/models/smollm2 --runs warm,1,2,shards2 --out OUT

Each run is `batchjson run` in its own process on a fresh output folder; `warm` is a small run that fills the
compile caches first. Prints one table (valid rows per wall-second, whole run and pass 1) and writes OUT/scale.json
with the samples: per GPU utilisation and memory, per process CPU% and thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq

from batchjson.engine.devices import visible_gpus
from batchjson.records import Stage
from batchjson.storage import Storage
from bench.common import P1, P2, cli
from bench.tasks import write_task


def gpu_sample() -> list[dict]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = [dict(zip(("gpu", "util", "mem_mb"), map(int, line.split(", ")))) for line in out.splitlines() if line]
    return gpus + [{"app": line} for line in apps.splitlines() if line]


def cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of the host's CPUs since boot (/proc/stat), or None where there is none."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


class HostSampler(threading.Thread):
    """Every second while a run goes: each GPU's utilisation and memory in use (nvidia-smi, where there is one) and
    the host's CPU busy fraction over that second (/proc/stat). `summary()` gives the means and peaks."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[dict] = []
        self.done = threading.Event()
        self.has_smi = shutil.which("nvidia-smi") is not None

    def run(self):
        last = cpu_times()
        while not self.done.wait(1.0):
            now = cpu_times()
            busy = (round((now[0] - last[0]) / (now[1] - last[1]), 3) if now and last and now[1] > last[1] else None)
            last = now
            self.samples.append({"t": time.time(), "cpu_busy": busy,
                                 "gpus": [g for g in gpu_sample() if "gpu" in g] if self.has_smi else []})

    def summary(self) -> dict:
        self.done.set()
        self.join()
        busy = [s["cpu_busy"] for s in self.samples if s["cpu_busy"] is not None]
        util = [g["util"] for s in self.samples for g in s["gpus"]]
        mem = [sum(g["mem_mb"] for g in s["gpus"]) for s in self.samples if s["gpus"]]
        return {"cpu_busy_mean": round(sum(busy) / len(busy), 3) if busy else None,
                "cpu_busy_max": max(busy, default=None),
                "gpu_util_mean": round(sum(util) / len(util), 1) if util else None,
                "gpu_util_max": max(util, default=None), "gpu_mem_used_max_mb": max(mem, default=None),
                "samples": self.samples}


class Sampler(threading.Thread):
    """Every second: each GPU's utilisation, and CPU% and threads of every process under the runs."""

    def __init__(self, roots: list[int]):
        super().__init__(daemon=True)
        self.roots, self.samples, self.done = roots, [], threading.Event()

    def run(self):
        procs: dict[int, psutil.Process] = {}
        while not self.done.wait(1.0):
            rows = []
            for root in self.roots:
                try:
                    tree = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
                except psutil.NoSuchProcess:
                    continue
                for p in tree:
                    procs.setdefault(p.pid, p)
                    try:
                        rows.append({"pid": p.pid, "root": root, "name": " ".join(p.cmdline()[:3])[-60:],
                                     "cpu": procs[p.pid].cpu_percent(), "threads": p.num_threads()})
                    except psutil.Error:
                        pass
            self.samples.append({"t": time.time(), "gpus": gpu_sample(), "procs": rows})


def launch(job: Path, out: Path, args: list[str], env: dict) -> subprocess.Popen:
    cmd = cli("run", str(job), "--output", str(out), *args)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = open(out.parent / f"{out.name}.log", "a")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)


def steady_rate(out: Path, started: float) -> dict:
    """Pass 1's rate once every engine is decoding: the rows of the commit records written after the first one,
    over the time from the first record to the last (records' mtimes), and when the first record landed."""
    commits = Storage(out).commits
    records = sorted(((commits.record_path(Stage.FIRST, r["key"]).info().mtime_ns / 1e9, r)
                      for r in commits.records(Stage.FIRST)), key=lambda t: t[0])
    if len(records) < 3:
        return {}
    span = records[-1][0] - records[0][0]
    rows = sum(sum(r["rows"].values()) for _, r in records[1:])
    return {"first_commit_s": round(records[0][0] - started, 1), "pass1_units": len(records),
            "steady_pass1_rows_per_s": round(rows / span, 2) if span > 0 else None}


def one(name: str, job: Path, root: Path, gpus: list[str]) -> dict:
    """One scenario: its processes, their reports, the samples taken while they ran."""
    base = os.environ | {"PYTHONUNBUFFERED": "1"}
    procs = []
    if name.startswith("shards"):
        n = int(name[6:])
        out = root / f"{name}-{time.time():.0f}"  # a new folder: --fresh cannot be used with --shard
        for i in range(n):  # the old way: one process per GPU, each on its own shard of one folder
            procs.append(launch(job, out, ["--shard", f"{i}/{n}"], base | ({"CUDA_VISIBLE_DEVICES": gpus[i]} if gpus else {})))
    else:
        n = 1 if name == "warm" else int(name)
        out = root / name
        procs.append(launch(job, out, ["--fresh", "--replicas", str(n)],
                            base | {"CUDA_VISIBLE_DEVICES": ",".join(gpus[:n])}))
    sampler = Sampler([p.pid for p in procs])
    started = time.time()
    sampler.start()
    reports = []
    for p in procs:
        p.communicate()
    for found in sorted(out.glob("_report*.json")):  # the reports the runs wrote (vLLM logs to stdout too)
        reports.append(json.loads(found.read_text()))
    reports += [{"error": f"exit {p.returncode}"} for p in procs if p.returncode]
    wall = time.time() - started
    sampler.done.set()
    sampler.join()
    valid = sum(sum(r.get("valid_by_pass", {}).values()) for r in reports if "error" not in r)
    steady = steady_rate(out, started)
    pass1 = [r["passes"][P1] for r in reports if P1 in r.get("passes", {})]
    busy = {}
    for s in sampler.samples:
        for g in s["gpus"]:
            if "gpu" in g:
                busy.setdefault(g["gpu"], []).append(g["util"])
    return {"run": name, "processes": len(procs), "wall_s": round(wall, 1), "valid": valid,
            "valid_per_wall_s": round(valid / wall, 2),
            "pass1_rows_per_s": [p["rows_per_s"] for p in pass1], "pass1_s": [p["seconds"] for p in pass1],
            "pass2_s": [r["passes"][P2]["seconds"] for r in reports if P2 in r.get("passes", {})],
            "gpu_util_mean": {g: round(sum(v) / len(v)) for g, v in busy.items() if v}, **steady,
            "reports": reports, "samples": sampler.samples}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench replicas", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="A")
    ap.add_argument("--rows", type=int, default=5000)
    ap.add_argument("--warm-rows", type=int, default=256)
    ap.add_argument("--model", default="/tmp/models/smollm2")
    ap.add_argument("--runs", default="warm,1,2")
    ap.add_argument("--out", default="scale-results")
    ap.add_argument("--work", default="/tmp/scale")
    ap.add_argument("--units", type=int, default=10, help="row groups (= units) the input is written in")
    a = ap.parse_args(argv)
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)

    results = []
    for name in a.runs.split(","):
        rows = a.warm_rows if name == "warm" else a.rows
        data, job = write_task(a.task, rows, work / f"task{a.task}-{rows}", a.model, bounded=True)
        if pq.ParquetFile(data).metadata.num_row_groups == 1:  # units (and static shards) split by row group
            pq.write_table(pq.read_table(data), data, row_group_size=max(1, -(-rows // a.units)))
        resumable = job.with_name(f"{job.stem}-resume.toml")  # shards need if_exists = "resume"; runs here are fresh
        resumable.write_text(job.read_text().replace('if_exists = "overwrite"', 'if_exists = "resume"'))
        job = resumable
        r = one(name, job, work / f"runs-{rows}", visible_gpus())
        results.append(r)
        print(f"[scale] {name}: {r['valid']} valid in {r['wall_s']} s = {r['valid_per_wall_s']} valid rows/s; pass 1 "
              f"{r['pass1_rows_per_s']} rows/s in {r['pass1_s']} s (steady {r.get('steady_pass1_rows_per_s')} rows/s, first "
              f"commit at {r.get('first_commit_s')} s); pass 2 {r['pass2_s']} s; GPU util {r['gpu_util_mean']}",
              flush=True)
        (out / "scale.json").write_text(json.dumps(results, indent=1))
    base = next((r for r in results if r["run"] == "1"), None)
    print("\n| run | processes | valid rows | wall s | valid rows/s | vs 1 GPU | pass 1 rows/s per process | steady pass 1 "
          "rows/s | vs 1 GPU | first commit s | mean GPU util % |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        ratio = f"×{r['valid_per_wall_s'] / base['valid_per_wall_s']:.2f}" if base and r["run"] != "warm" else ""
        steady = r.get("steady_pass1_rows_per_s")
        sratio = (f"×{steady / base['steady_pass1_rows_per_s']:.2f}" if steady and base and base.get("steady_pass1_rows_per_s")
                  and r["run"] != "warm" else "")
        print(f"| {r['run']} | {r['processes']} | {r['valid']} | {r['wall_s']} | {r['valid_per_wall_s']} | {ratio} | "
              f"{r['pass1_rows_per_s']} | {steady} | {sratio} | {r.get('first_commit_s')} | {r['gpu_util_mean']} |")
    return 0

