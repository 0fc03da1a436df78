"""What the benchmarks share: job specs with overrides, input files, prompts and their check against ground truth,
the `batchjson` command line (or its fake-engine twin), the subprocess harness, RSS sampling, tables."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

from batchjson.engine.vllm.drafts import SCHEMA_PROPOSER
from batchjson.records import Stage

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "jobs" / "sample.toml"
MB = 1024 * 1024
WORK = Path(os.environ.get("BATCHJSON_BENCH_WORK", "/tmp/batchjson-bench"))
# Set by `python -m bench smoke`: `batchjson run` then runs on the fake engine (bench/fakerun.py), with no model.
FAKE = "BATCHJSON_BENCH_FAKE"
P1, P2 = Stage.FIRST.label, Stage.SECOND.label  # the report's names of the passes (its "passes")


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


# The speculative_config of each method as the benchmarks run it in bare vLLM (and batchjson's k for it): "schema" is
# batchjson's drafter as vLLM's custom_class proposer (engine/vllm/drafts.py), or on vLLM 0.34 the method it registers
# (`speculative`).
SPECULATIVE = {"suffix": {"method": "suffix", "num_speculative_tokens": 8},
               "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
               "draft": {"method": "draft_model", "num_speculative_tokens": 4},
               "schema": {"method": "custom_class", "model": SCHEMA_PROPOSER, "num_speculative_tokens": 8}}


def speculative(method: str, schema: dict | None, k: int | None = None, adaptive: bool = False) -> dict:
    """SPECULATIVE[method], where "schema" is the method batchjson registers where vLLM has a registry of them (0.34:
    engine/vllm/schema_speculator/), drafting from `schema` (the one the engine decodes under); `k` drafts a request
    (None: SPECULATIVE's); `adaptive`: Model Runner V2's adaptive verification (vLLM 0.34; off by default)."""
    from batchjson.engine.vllm import schema_speculator

    config = dict(SPECULATIVE[method])
    if k:
        config["num_speculative_tokens"] = k
    if method == "schema" and schema_speculator.register():
        config = schema_speculator.speculative_config(config["num_speculative_tokens"], schema, {})
    return config | ({"enable_adaptive_verification": True} if adaptive else {})


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


# ---------------------------------------------------------------- prompts and ground truth

def frame(llm, system: str) -> tuple[str, str]:
    """The chat frame batchjson renders (prompts.chat_frame), from a started vllm.LLM's tokenizer."""
    from batchjson.prompts import MARK

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": MARK}]
    text = llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prefix, _, suffix = text.partition(MARK)
    return prefix, suffix


def spec_prompts(spec, chat: tuple[str, str]) -> list:
    """Every input row of a job spec rendered as batchjson renders it (the same Renderer and chat frame)."""
    from batchjson.prompts import Renderer
    from batchjson.records import Prompt
    from batchjson.source import ParquetSource

    renderer = Renderer(spec.prompt, chat, spec.input.id_column, spec.input.passthrough)
    source = ParquetSource(spec.input, spec.prompt.columns)
    return [p for unit in source.read(source.plan()) for p in renderer.render(unit) if isinstance(p, Prompt)]


def task_prompts(task: str, rows: int, chat: tuple[str, str]) -> tuple[list[str], list[str], list[str]]:
    """(ids, prompt texts, truth JSON) for `rows` rows of a bench/tasks.py task, in the chat frame `chat`."""
    from bench.tasks import TASKS, rows as task_rows

    data, t = task_rows(task, rows), TASKS[task]
    return ([r[0] for r in data], [chat[0] + t["template"].format(text=r[1]) + chat[1] for r in data],
            [r[2] for r in data])


def check(task: str, validator, text: str, finish: str, truth: str) -> tuple[bool, bool, float, str | None]:
    """One output as batchjson judges it (parse, schema, finish reason), then against the task's ground truth:
    (valid, exactly right, share of fields right, reject reason)."""
    from batchjson.records import Generation, Prompt
    from bench.tasks import score

    o = validator.check(Generation(Prompt("x", "u", ""), text, finish, 0, 0))
    exact, fields = score(task, o.value, truth) if o.ok else (False, 0.0)
    return o.ok, exact, fields, o.reason


# ---------------------------------------------------------------- the command line, in its own process

def cli(*args: str) -> list[str]:
    """The `batchjson` command with `args`; under the smoke (BATCHJSON_BENCH_FAKE) its fake-engine twin."""
    return [sys.executable, "-m", "bench.fakerun" if os.environ.get(FAKE) else "batchjson", *args]


def run_cli(job: Path, out: Path, *args: str, timeout: float | None = None, env: dict | None = None
            ) -> tuple[int | str, dict | None, str]:
    """`batchjson run JOB --output OUT --fresh ARGS` as a user runs it: (exit code or "timeout", the report or
    None, the tail of its output)."""
    env = (env or os.environ) | {"PYTHONUNBUFFERED": "1"}
    try:
        p = run_group(cli("run", str(job), "--output", str(out), "--fresh", *args), timeout, env=env)
    except subprocess.TimeoutExpired:
        return "timeout", None, ""
    report = out / "_report.json"
    ok = p.returncode == 0 and report.exists()
    return p.returncode, json.loads(report.read_text()) if ok else None, (p.stderr or p.stdout)[-1500:]


def _kill_group(p: subprocess.Popen) -> None:
    """Kill `p`'s process group (started with start_new_session): vLLM's engine core too, which outlives a killed
    parent and keeps its GPU memory (a bare run's timeout left 133 GB held, and every later engine failed to start)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


@contextlib.contextmanager
def killed_at_end(p: subprocess.Popen):
    """Kill `p`'s group (start_new_session) when the block ends, however it ends: a timeout, a clean exit, Ctrl-C
    here (the group, in a session of its own, does not get the terminal's signal) or a SIGTERM here (it then ends
    this process as SystemExit 143, once the group is killed)."""
    main = threading.current_thread() is threading.main_thread()  # only there can a signal handler be set
    before = signal.signal(signal.SIGTERM, _exit_143) if main else None
    try:
        yield p
    finally:
        _kill_group(p)
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)


def _exit_143(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run_group(command: list[str], timeout: float | None, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs), in a process group of its
    own that is killed at the end (killed_at_end); a timeout raises TimeoutExpired as subprocess.run does."""
    with killed_at_end(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        start_new_session=True, **kwargs)) as p:
        out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(command, p.returncode, out, err)


def one_process(subcommand: str, cfg: dict, timeout: float, **kwargs) -> dict:
    """One configuration of a benchmark in a process of its own: `python -m bench SUBCOMMAND _one CFG`, whose module
    answers it with `answer_one`. Its result, or {"error": ...} (its exit code and output's end, or its timeout)."""
    Path(cfg["result"]).unlink(missing_ok=True)
    try:
        proc = run_group([sys.executable, "-m", "bench", subcommand, "_one", json.dumps(cfg)], timeout, cwd=ROOT,
                         **kwargs)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"error": f"rc {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}"}
    return json.loads(Path(cfg["result"]).read_text())


def answer_one(argv: list[str], one) -> bool:
    """In a benchmark's main: where `argv` is one_process's call, run `one(cfg)` in this process and write its result
    where cfg["result"] says. Whether it was that call."""
    if argv[:1] != ["_one"]:
        return False
    cfg = json.loads(argv[1])
    Path(cfg["result"]).write_text(json.dumps(one(cfg)))
    return True


def run_isolated(argv: list[str], timeout: float, log: Path, label: str) -> int | None:
    """Run `python -m bench ARGV` in a fresh process group, its output appended to `log`; a timeout (None back)
    or the end of the run kills the whole group, the engine core with it. The exit code back, else None."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"\n===== {label} {time.strftime('%H:%M:%S')} =====\n")
        f.flush()
        with killed_at_end(subprocess.Popen([sys.executable, "-m", "bench", *argv], cwd=ROOT, stdout=f,
                                            stderr=subprocess.STDOUT, start_new_session=True)) as p:
            try:
                return p.wait(timeout=timeout)  # the worker's engine core is killed after it, even after a clean exit
            except subprocess.TimeoutExpired:
                return None
