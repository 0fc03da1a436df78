"""Shared by the benchmark's parent and its workers: job specs with overrides, input files, RSS sampling, tables."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "jobs" / "sample.toml"
MB = 1024 * 1024


def make_rows(n: int, folder: Path, seed: int = 0) -> Path:
    """The sample task's invoice rows (sample_data/make_sample.py), n of them; made once per (n, seed)."""
    path = folder / f"rows-{n}-s{seed}.parquet"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{path.name}")
        subprocess.run([sys.executable, str(ROOT / "sample_data" / "make_sample.py"), "--rows", str(n),
                        "--seed", str(seed), "--out", str(tmp)], check=True, stdout=subprocess.DEVNULL)
        os.replace(tmp, path)
    return path


def build_spec(sc: dict):
    """jobs/sample.toml with the scenario's overrides; everything not overridden is the sample job's setting.

    Keys of `sc`: input, model, output, max_in_flight, engine (extra vllm.LLM kwargs; max_num_seqs defaults to
    max_in_flight), method, k, draft_model, max_tokens, fallback (bool), batch_size.
    """
    from batchjson.spec import parse_spec

    doc = tomllib.loads(JOB.read_text())
    doc["input"]["path"] = str(sc["input"])
    if sc.get("batch_size"):
        doc["input"]["batch_size"] = int(sc["batch_size"])
    model = doc.setdefault("model", {})
    model["path"] = sc.get("model", "default")
    model["max_in_flight"] = int(sc.get("max_in_flight", 256))
    model["engine"] = {"max_num_seqs": model["max_in_flight"], **sc.get("engine", {})}
    spec = doc.setdefault("speculative", {})
    if "method" in sc:
        spec["method"] = sc["method"]
    if "k" in sc:
        spec["num_speculative_tokens"] = int(sc["k"])
    if spec.get("method") == "draft_model":
        spec["draft_model"] = sc.get("draft_model") or model["path"]
    if sc.get("max_tokens"):
        doc.setdefault("sampling", {})["max_tokens"] = int(sc["max_tokens"])
    if sc.get("fallback") is False:
        doc.setdefault("fallback", {})["enabled"] = False
    doc["output"] = {"path": str(sc.get("output", "/tmp/batchjson-bench/out")), "if_exists": "overwrite",
                     "max_reject_rate": 1.0}
    return parse_spec(doc, JOB.parent, str(JOB))


class RssMonitor(threading.Thread):
    """Peak resident memory of this process (the runner) and of its children (vLLM's engine core), sampled."""

    def __init__(self, every: float = 0.2):
        super().__init__(daemon=True)
        import psutil

        self.proc, self.every = psutil.Process(), every
        self.peak_self = self.peak_children = 0
        self._halt = threading.Event()

    def sample(self) -> None:
        rss = self.proc.memory_info().rss
        kids = 0
        for child in self.proc.children(recursive=True):
            try:
                kids += child.memory_info().rss
            except Exception:  # a child that ended between listing and reading
                pass
        self.peak_self, self.peak_children = max(self.peak_self, rss), max(self.peak_children, kids)

    def run(self) -> None:
        while not self._halt.wait(self.every):
            try:
                self.sample()
            except Exception:
                pass

    def stop(self) -> dict:
        self._halt.set()
        self.join(timeout=2)
        # ru_maxrss is the exact peak of this process (KiB on Linux); the sampler may miss a short spike.
        peak = max(self.peak_self, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        return {"runner_peak_rss_mb": round(peak / MB, 1), "engine_peak_rss_mb": round(self.peak_children / MB, 1)}


class Clock:
    """Wall and process-CPU time of a block."""

    def __enter__(self):
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0


def rate(n: float, seconds: float) -> float:
    return round(n / seconds, 3) if seconds else 0.0


def dump(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    """A Markdown table of `rows` with (key, header) columns; missing values print as '-'."""
    def fmt(v):
        if v is None or v == "":
            return "-"
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
        return str(v)

    body = [[fmt(r.get(k)) for k, _ in cols] for r in rows]
    heads = [h for _, h in cols]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(heads)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(heads), "| " + " | ".join("-" * w for w in widths) + " |", *map(line, body)])
