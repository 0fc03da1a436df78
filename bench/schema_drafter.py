"""The schema drafter as vLLM 0.34's registered speculative method (batchjson/engine/vllm/schema_speculator/): does it run,
keep greedy outputs token for token, and what does it give?

    python -m bench schema-drafter --model MODEL_DIR [--task C] [--rows 512] [--k 8] [--max-num-seqs 256]
                                   [--sides none,schema] [--out OUT]

On a GPU with vLLM 0.34 and batchjson's vLLM plugin registered (bench/gpu/register_plugin.sh where batchjson is not
pip-installed): one vllm.LLM per side, each in its own process, decodes the task's prompts greedily under its JSON
Schema (xgrammar, no whitespace); `schema` adds speculative_config {"method": "batchjson_schema",
"num_speculative_tokens": k} (other sides: none, ngram, suffix; --options adds keys to each drafting side's).
Prints each side's generate seconds, its speed against `none`, acceptance (vLLM's spec_decode counters) and how
many rows' tokens equal `none`'s; writes OUT/summary.json.

    python -m bench schema-drafter --fake --vllm-src DIR --tokenizer MODEL_DIR     # bench smoke: no engine

A job file's `[speculative] method = "schema"` through batchjson's engine settings to the registered method (vLLM
0.34's registry, its Python file from DIR where this vLLM lacks it), its SpeculatorConfig set up, then the
speculator's work (steps.py) over the task's ground-truth answers as Model Runner V2 would ask for it, on CPU
tensors, with a target that writes each answer: tokens per step and acceptance. Exits 1 if any of it fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import types
from pathlib import Path

from bench.common import ROOT, answer_one, dump, one_process, table

SIDES = ("none", "schema", "ngram", "suffix")


def side_config(side: str, k: int, schema: dict, options: dict) -> dict | None:
    from batchjson.engine.vllm import schema_speculator

    if side == "none":
        return None
    if side == "schema":
        return schema_speculator.speculative_config(k, schema, options)
    return {"method": side, "num_speculative_tokens": k} | options


def one(cfg: dict) -> dict:
    """One side on a real engine: its outputs' tokens, generate seconds and spec_decode counters."""
    from importlib.metadata import entry_points

    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from batchjson.engine.vllm import schema_speculator
    from bench.common import frame, task_prompts
    from bench.scenarios import acceptance, spec_counters
    from bench.tasks import TASKS, schema as task_schema

    if cfg["side"] == "schema":
        plugins = [p.value for p in entry_points(group="vllm.general_plugins")]
        if "batchjson.engine.plugin:register" not in plugins or not schema_speculator.register():
            raise SystemExit("the schema drafter needs vLLM 0.34 and batchjson's vLLM plugin registered in every vLLM "
                             "process: pip install batchjson, or bash bench/gpu/register_plugin.sh")
    schema = task_schema(cfg["task"])
    llm = LLM(model=cfg["model"], max_num_seqs=cfg["max_num_seqs"], max_model_len=cfg["max_model_len"], seed=0,
              disable_log_stats=False, speculative_config=side_config(cfg["side"], cfg["k"], schema, cfg["options"]),
              structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
    _, prompts, _ = task_prompts(cfg["task"], cfg["rows"], frame(llm, TASKS[cfg["task"]]["system"]))
    params = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"],
                            structured_outputs=StructuredOutputsParams(json=schema))
    llm.generate(prompts[:16], params, use_tqdm=False)  # warm-up
    before = spec_counters(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = spec_counters(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"side": cfg["side"], "seconds": round(seconds, 3), "tokens": tokens,
            "output_tokens": sum(map(len, tokens)), "acceptance": acceptance(before, after),
            "drafts": after["drafts"] - before["drafts"],
            "accepted_tokens": after["accepted_tokens"] - before["accepted_tokens"]}


def compare(args) -> int:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for side in args.sides.split(","):
        cfg = {"side": side, "model": args.model, "task": args.task, "rows": args.rows, "k": args.k,
               "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
               "max_tokens": args.max_tokens, "options": json.loads(args.options), "result": str(out / f"{side}.json")}
        results.append(one_process("schema-drafter", cfg, args.timeout) | {"side": side})
    base = next((r for r in results if r["side"] == "none" and "tokens" in r), None)
    rows = []
    for r in results:
        row = {"side": r["side"], "error": r.get("error", "")[-300:]}
        if "tokens" in r:
            row |= {k: r[k] for k in ("seconds", "output_tokens", "acceptance", "drafts", "accepted_tokens")}
            if base:
                row["speed"] = round(base["seconds"] / r["seconds"], 2)
                row["identical"] = f"{sum(a == b for a, b in zip(r['tokens'], base['tokens']))}/{len(base['tokens'])}"
        rows.append(row)
    print(table(rows, [("side", "side"), ("seconds", "generate s"), ("speed", "x none"), ("output_tokens", "tokens"),
                       ("acceptance", "acceptance"), ("accepted_tokens", "accepted"), ("identical", "rows = none"),
                       ("error", "error")]))
    dump(out / "summary.json", {"args": {k: str(v) for k, v in vars(args).items()}, "sides": rows})
    return 0 if all("tokens" in r for r in results) else 1


# ---------------------------------------------------------------- --fake: no engine (bench smoke)

def use_registry(root: Path) -> types.ModuleType:
    """vLLM 0.34's registry of speculative methods: this vLLM's own, else its Python file under `root` (it imports
    nothing that vLLM 0.32 lacks), made this process's."""
    from batchjson.engine.vllm import schema_speculator

    if importlib.util.find_spec("vllm.v1.worker.gpu.spec_decode") and schema_speculator.register():
        return sys.modules[schema_speculator.REGISTRY]
    path = next((p for p in (root / "vllm", root / "src" / "vllm") if p.is_dir()), root / "vllm")
    path = path / "v1/worker/gpu/spec_decode/speculator_config.py"
    if not path.is_file():
        raise SystemExit(f"--vllm-src: no vLLM 0.34 sources in {root} ({path} is missing)")
    spec = importlib.util.spec_from_file_location(schema_speculator.REGISTRY, path)
    module = sys.modules[schema_speculator.REGISTRY] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def settings(folder: Path, k: int):
    """A task-C job file with `[speculative] method = "schema"`, through batchjson's engine settings: its vLLM
    speculative_config, and the config class vLLM's registry gives for the method it names, set up."""
    from batchjson.engine.vllm import schema_speculator
    from batchjson.engine.vllm_engine import engine_settings
    from batchjson.spec import load_spec
    from bench.tasks import write_task

    model = folder / "model"  # engine settings read no weights: a folder that names itself a model is enough
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text("{}")
    _, job = write_task("C", 4, folder, str(model), extra=f'\n[speculative]\nmethod = "schema"\n'
                                                          f"num_speculative_tokens = {k}\n")
    spec = load_spec(job)
    choice, kwargs = engine_settings(spec.model, spec.sampling, spec.schema_doc, spec.speculative, cpu=False)
    config = kwargs["speculative_config"]
    assert config["method"] == schema_speculator.METHOD, config
    assert json.loads(config["speculator_options"]["json_schema"]) == choice.grammar_schema
    registry = sys.modules[schema_speculator.REGISTRY]
    config_cls = registry.get_custom_speculator_config_class(config["method"])
    vllm_spec = types.SimpleNamespace(target_model_config="target", target_parallel_config="tp",
                                      **{k: config[k] for k in ("num_speculative_tokens", "speculator_options")})
    config_cls.configure(vllm_spec)
    config_cls.apply_options(vllm_spec)
    assert vllm_spec.draft_model_config == "target", vars(vllm_spec)
    return config, config_cls


def lockstep(compiled, encode, cases, k: int) -> dict:
    """The speculator's work (steps.py) over `cases` (prompt index, answer tokens) in one batch, as Model Runner V2
    asks for it after each step: the request states as CPU tensors, a target that takes each draft's prefix that its
    answer continues with, then one token of its own."""
    import numpy as np
    import torch

    from batchjson.engine.vllm.schema_speculator.steps import StepDrafts, read_rows, read_step

    drafts = StepDrafts(encode, compiled, k)
    n, length = len(cases), max(len(p.prompt) + len(a) for p, a in cases) + 1
    tokens, total = torch.zeros((n, length), dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
    prompt_lens = np.array([len(p.prompt) for p, _ in cases])
    for slot, (prompt, _) in enumerate(cases):
        drafts.add(slot)
        tokens[slot, :len(prompt.prompt)] = torch.tensor(prompt.prompt)
        total[slot] = len(prompt.prompt)
    proposed = np.zeros((n, k), dtype=np.int64)
    steps = accepted = 0
    while any(int(total[s]) - prompt_lens[s] < len(cases[s][1]) for s in range(n)):
        sampled = torch.zeros(n, dtype=torch.int32)
        for s, (_, answer) in enumerate(cases):
            done = int(total[s]) - prompt_lens[s]
            if done >= len(answer):
                continue
            taken = 0
            while steps and taken < k and done + taken < len(answer) and proposed[s, taken] == answer[done + taken]:
                taken += 1
            new = answer[done:done + taken + 1]
            tokens[s, int(total[s]):int(total[s]) + len(new)] = torch.tensor(new, dtype=torch.int32)
            total[s] += len(new)
            sampled[s], accepted = len(new), accepted + taken
        slots, idx = list(range(n)), torch.arange(n)
        totals, counts, tails = read_step(tokens, total, idx, sampled, drafts.window())
        unknown = [r for r in drafts.unknown(slots, prompt_lens, totals) if counts[r] > 0]
        drafts.draft(slots, prompt_lens, totals, counts, tails, read_rows(tokens, idx, unknown, totals), proposed)
        steps += 1
    same = all(tokens[s, prompt_lens[s]:int(total[s])].tolist() == a for s, (_, a) in enumerate(cases))
    answer_tokens = sum(len(a) for _, a in cases)
    return {"rows": n, "tokens": answer_tokens, "steps": steps, "tokens_per_step": round(answer_tokens / steps / n, 2),
            "accepted": accepted, "outputs_are_the_answers": same}


def fake(args) -> int:
    from bench.drafts import task_cases

    config, config_cls = settings(args.out / "job", args.k)
    print(f"[speculative] method = \"schema\" -> speculative_config method {config['method']!r} -> "
          f"{config_cls.__module__}.{config_cls.__name__} -> {config_cls.speculator_class}")
    compiled, encode, _, cases = task_cases("C", args.rows, args.tokenizer)
    result = lockstep(compiled, encode, cases, args.k)
    print(table([result], [(k, k) for k in result]))
    dump(args.out / "fake.json", result | {"method": config["method"]})
    return 0 if result["outputs_are_the_answers"] and result["accepted"] > 0 else 1


def main(argv: list[str]) -> int:
    if answer_one(argv, one):
        return 0
    ap = argparse.ArgumentParser(prog="python -m bench schema-drafter", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="the target model's folder (a real engine: vLLM 0.34 on a GPU)")
    ap.add_argument("--task", default="C", help="a bench/tasks.py task with a schema (A, B, C, D)")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--sides", default="none,schema", help=f"comma-separated, of {', '.join(SIDES)}")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--options", default="{}", help='more speculative_config keys for the drafting sides, as JSON '
                    '(e.g. \'{"enable_adaptive_verification": true}\')')
    ap.add_argument("--timeout", type=float, default=1200, help="seconds for each side's process")
    ap.add_argument("--fake", action="store_true", help="no engine: the settings path and the speculator's work")
    ap.add_argument("--vllm-src", type=Path, default=Path(sys.prefix) / "vllm-0.34",
                    help="--fake: vLLM 0.34's Python sources, where this vLLM has no registry of methods")
    ap.add_argument("--tokenizer", help="--fake: a model folder with a tokenizer")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "schema-drafter")
    args = ap.parse_args(argv)
    if args.fake:
        if not args.tokenizer:
            ap.error("--fake needs --tokenizer")
        use_registry(args.vllm_src)
        args.rows = min(args.rows, 32)
        return fake(args)
    if not args.model or not set(args.sides.split(",")) <= set(SIDES):
        ap.error(f"--model is required, and --sides takes {', '.join(SIDES)}")
    return compare(args)
