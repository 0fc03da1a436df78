"""The benchmarks' smoke test (`make bench-smoke`, in CI): every subcommand, tiny, on the fake engine; exits 1 on any
failure, so a renamed or removed product function breaks CI rather than a GPU run.

    python -m bench smoke [--work DIR]

Two parts. First a static check of every module in bench/: each name it takes from batchjson or bench (imports,
also those inside functions, and attribute chains on them such as `job.JobRun.run`) must exist, so the parts that
only run beside a real engine are checked too. Then each subcommand runs in its own process: those that run
batchjson do so on the fake engine (BATCHJSON_BENCH_FAKE: `batchjson run` is bench/fakerun.py), with a model folder
that holds only a tokenizer; those that need a real vLLM engine (compare, sweep, scale, gpu, spec-profile) show
their --help, and whole-runs runs only its batchjson side (two replicas sharing a pretended GPU among them). Its
time is in docs/development.md.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import FAKE, ROOT, run_group, table

BENCH = ROOT / "bench"
# Candidates some benchmarks try when they are importable (validators.py, overhead.py's what-ifs), and suffix decoding.
OPTIONAL = {"fastjsonschema", "jsonschema_rs", "arctic_inference"}
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


# ---------------------------------------------------------------- the static check

def _resolve(dotted: str) -> bool:
    """Whether `a.b.c.d` exists: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def _chain(node: ast.AST) -> list[str] | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return [node.id, *reversed(names)] if isinstance(node, ast.Name) else None


def static_problems(path: Path) -> list[str]:
    """What `path` takes from batchjson or bench that does not exist, and imports of bench modules by their bare
    names (they worked only with bench/ on sys.path)."""
    tree = ast.parse(path.read_text(), str(path))
    siblings = {p.stem for p in BENCH.glob("*.py")}
    guarded: set[int] = set()  # imports inside `try: ... except ImportError`: optional candidates
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any("ImportError" in ast.unparse(h.type or ast.Name("")) for h in node.handlers):
            guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    aliases, problems = {}, []
    rebound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    rebound |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args + n.kwonlyargs}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            pairs = [(a.name, a.asname or a.name.split(".")[0], a.asname is None) for a in node.names]
            mod = None
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            mod = node.module
            pairs = [(f"{mod}.{a.name}", a.asname or a.name, False) for a in node.names]
        else:
            continue
        for full, bound, bare_import in pairs:
            top = full.split(".")[0]
            if top in siblings and top != "bench":
                problems.append(f"line {node.lineno}: imports {top!r}; bench modules are imported as bench.{top}")
            elif top in ("batchjson", "bench"):
                if not _resolve(full):
                    problems.append(f"line {node.lineno}: {full} does not exist")
                aliases[bound] = top if bare_import else full
            elif id(node) not in guarded and top not in OPTIONAL and importlib.util.find_spec(mod.split(".")[0] if mod else top) is None:
                problems.append(f"line {node.lineno}: {top} is not importable here")
    for node in ast.walk(tree):
        chain = _chain(node) if isinstance(node, ast.Attribute) else None
        if chain and chain[0] in aliases and chain[0] not in rebound:
            dotted = ".".join([aliases[chain[0]], *chain[1:]])
            if not _resolve(dotted):
                problems.append(f"line {node.lineno}: {dotted} does not exist")
    return sorted(set(problems))


# ---------------------------------------------------------------- the runs

def harness_problems(w: Path) -> list[str]:
    """A run killed at its timeout, or whose caller gets a SIGTERM, takes its children along (run_group): a child
    that outlives its parent, as vLLM's engine core does, would keep the GPU's memory from every later run."""
    pid_file = w / "grandchild.pid"
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            f" open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    problems = []
    try:
        run_group([sys.executable, "-c", code], 5)
        problems.append("run_group: the run did not time out")
    except subprocess.TimeoutExpired:
        problems += _still_runs(pid_file, "the timed-out run's child")
    pid_file.unlink(missing_ok=True)
    caller = subprocess.Popen([sys.executable, "-c", f"from bench.common import run_group; import sys; "
                               f"run_group([sys.executable, '-c', {code!r}], 60)"], cwd=ROOT)
    for _ in range(100):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.1)
    caller.terminate()
    rc = caller.wait(30)
    problems += [f"run_group: its caller ended with {rc} on SIGTERM, not 143"] if rc != 143 else []
    return problems + _still_runs(pid_file, "the run's child after its caller's SIGTERM")


def _still_runs(pid_file: Path, what: str) -> list[str]:
    pid = pid_file.read_text() if pid_file.exists() else ""
    if not pid:
        return [f"run_group: {what} never started"]
    time.sleep(0.5)
    status = Path(f"/proc/{pid}/status")
    alive = status.exists() and "\tZ" not in status.read_text().split("State:", 1)[1].split("\n", 1)[0]
    return [f"run_group: {what} {pid} still runs"] if alive else []


def tokenizer_model(folder: Path) -> Path:
    """A model folder with a tokenizer and a chat template and no weights: enough for batchjson's prompts and the
    fake engine (the embedded SmolLM2 would be converted first, a minute on a fresh machine)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<|im_start|>", "<|im_end|>", *"{ } [ ] : , \" vendor total items invoice".split()]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    return folder


def byte_tokenizer(folder: Path) -> Path:
    """A byte-level tokenizer of 256 tokens and an end token, no merges: every text tokenizes, for xgrammar alone
    (`grammar --matchers`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|im_end|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>").save_pretrained(folder)
    return folder


def schemastore_checkout(folder: Path) -> Path:
    """A SchemaStore-shaped git repository of two schemas (one referring to the other) and two test instances."""
    files = {"src/schemas/json/order.json": {"type": "object", "properties": {"line": {"$ref": "line.json"}}},
             "src/schemas/json/line.json": {"type": "object", "properties": {"n": {"type": "integer"}}},
             "src/test/order/ok.json": {"line": {"n": 2}}, "src/negative_test/order/bad.json": {"line": {"n": "x"}}}
    for name, doc in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(doc))
    git = ["git", "-C", str(folder), "-c", "user.name=smoke", "-c", "user.email=smoke@example.com"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "smoke"]):
        subprocess.run(git + args, check=True)
    return folder


def plan(w: Path, model: Path) -> list[tuple]:
    """(subcommand, its arguments[, its environment's changes]) in order; a run may read what an earlier one
    wrote."""
    m = ["--model", str(model)]
    return [
        ("overhead", ["--rows", "200", "--max-in-flight", "16", "--timeout", "120", "--out", str(w / "thr"), *m]),
        ("report", [str(w / "thr" / "overhead.json")]),
        *[(name, ["--help"]) for name in ("compare", "sweep", "scale", "gpu", "spec-profile")],
        ("start-trace", ["--help"]),  # whole-runs' auto+trace below runs it
        ("grammar", ["--help"]),  # its engine runs need vLLM; xgrammar alone runs on the tokenizer:
        ("grammar", ["--matchers", str(byte_tokenizer(w / "bytes")), "--task", "C", "--rows", "20", "--seqs", "8,16", "--threads", "1",
                     "--out", str(w / "grammar")]),
        ("grammar", ["--masks", "--seqs", "8", "--drafts", "0,3", "--vocab", "1000", "--repeat", "2",
                     "--out", str(w / "masks")]),
        ("ahead", ["--vllm-src", str(Path(sys.prefix) / "vllm-0.26"), "--configs", "ahead,free", "--rows", "24",
                   "--seqs", "8", "--min-requests", "1", "--out", str(w / "ahead")]),  # make install fetched vLLM 0.26
        ("drafts", ["--tasks", "C", "--rows", "6", "--ks", "4", "--tokenizer", str(byte_tokenizer(w / "bytes-drafts")),
                    "--out", str(w / "drafts")]),
        ("schema-drafter", ["--fake", "--vllm-src", str(Path(sys.prefix) / "vllm-0.34"), "--rows", "8", "--tokenizer",
                            str(byte_tokenizer(w / "bytes-spec")), "--out", str(w / "schema-drafter")]),
        ("drafts", ["--cost", "--tasks", "C", "--rows", "6", "--ks", "4", "--tokenizer",
                    str(byte_tokenizer(w / "bytes-drafts")), "--out", str(w / "drafts-cost")]),
        # Two replicas on one (pretended) GPU: the fake engine needs none, the layout only CUDA_VISIBLE_DEVICES.
        ("whole-runs", ["--task", "A", "--rows", "24", "--runs",
                        "none+warm,none+gpus1,none+gmu0.3+cg1024,auto+trace,none-nofills+stats+prof",
                        "--replicas-per-gpu", "1,2", "--timeout", "120",
                        "--budget", "230", "--out", str(w / "whole"), "--work", str(w / "whole-work"), *m],
         {"CUDA_VISIBLE_DEVICES": "0"}),
        ("auto-runs", ["--tasks", "A", "--in-flight", "4", "--min-rows", "4", "--timeout", "90",
                       "--out", str(w / "auto"), "--work", str(w / "auto-work"), *m]),
        ("cpu-sample", ["--sides", "batchjson", "--out", str(w / "cpu-sample.jsonl")]),
        ("sample-guard", ["--out", str(w / "sample-guard")]),
        ("repetition-scan", [str(w / "sample-guard" / "out-*"), *m]),  # the first of sample-guard's runs
        ("replicas", ["--task", "A", "--rows", "40", "--warm-rows", "8", "--units", "4", "--runs", "1,shards2",
                      "--out", str(w / "replicas"), "--work", str(w / "replicas-work"), *m]),
        ("guard-cost", ["--repeat", "1"]),
        ("openai-batch", ["--lines", "300", "--work", str(w / "openai-batch")]),
        ("serve", ["--lines", "300", "--work", str(w / "serve")]),
        ("scale-out", ["--rows", "3000", "--workers", "2", "--verify", "--work", str(w / "scale-out")]),
        ("validators", []),
        ("schemas", ["--limit", "5", "--out", str(w / "schemas.json")]),
        ("extract-schemastore", [str(w / "schemastore"), "--out", str(w / "corpus.jsonl.gz")]),
        ("schemas", ["--corpus", str(w / "corpus.jsonl.gz"), "--out", str(w / "schemas-tiny.json")]),
    ]


def main(argv: list[str] | None = None) -> int:
    from bench.__main__ import COMMANDS

    ap = argparse.ArgumentParser(prog="python -m bench smoke", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, help="keep what the runs write here (default: a temporary folder)")
    args = ap.parse_args(argv)
    started = time.monotonic()
    failures = []
    for path in sorted(BENCH.glob("*.py")):
        failures += [f"{path.relative_to(ROOT)} {p}" for p in static_problems(path)]
    print(f"[smoke] static check of {len(list(BENCH.glob('*.py')))} modules: {len(failures)} problem(s)", flush=True)
    w = args.work or Path(tempfile.mkdtemp(prefix="bench-smoke-"))
    w.mkdir(parents=True, exist_ok=True)
    failures += harness_problems(w)
    model = tokenizer_model(w / "model")
    schemastore_checkout(w / "schemastore")
    env = os.environ | {FAKE: str(model), "BATCHJSON_BENCH_WORK": str(w / "work"), "CUDA_VISIBLE_DEVICES": "",
                        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    runs = plan(w, model)
    steps = [(name, [sys.executable, "-m", "bench", name, *a], more[0] if more else {}) for name, a, *more in runs]
    missing = [n for n, (_, what) in COMMANDS.items() if what and n != "smoke" and n not in {r[0] for r in runs}]
    failures += [f"{n}: no smoke run (add one to bench/smoke.py's plan)" for n in missing]
    rows = []
    for name, cmd, changes in steps:
        cmd = [next(iter(sorted(w.glob(str(Path(a).relative_to(w))))), a) if "*" in a else a for a in cmd]
        cmd = [str(a) for a in cmd]
        t = time.monotonic()
        log = w / "logs" / f"{len(rows):02d}-{name}.log"
        log.parent.mkdir(exist_ok=True)
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env | changes, capture_output=True, text=True, timeout=240)
            rc, out = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc, out = "timeout", str(e.stdout or "") + str(e.stderr or "")
        log.write_text(out)
        rows.append({"run": name, "args": " ".join(cmd[3:])[:70], "rc": rc, "s": round(time.monotonic() - t, 1)})
        print(f"[smoke] {name}: rc {rc} in {rows[-1]['s']} s", flush=True)
        if rc != 0:
            failures.append(f"{name} exited {rc} ({log}):\n" + "\n".join(out.splitlines()[-20:]))
    print(table(rows, [("run", "subcommand"), ("args", "arguments"), ("rc", "exit"), ("s", "s")]))
    print(f"\n# bench smoke: {len(steps)} runs in {time.monotonic() - started:.0f} s; work folder {w}")
    if failures:
        print(f"# {len(failures)} failure(s):\n" + "\n".join(failures))
        return 1
    return 0
