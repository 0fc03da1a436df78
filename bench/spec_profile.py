"""Where a speculative step's time goes under a JSON-schema grammar: one method, one in-flight size, one run.

    python -m bench spec-profile --model /tmp/models/smollm2 --method ngram --in-flight 1,8,32,128,512
    python -m bench spec-profile --model /tmp/models/smollm2 --shape llama-8b --method ngram --in-flight 1,8,32

Starts one engine (batchjson's VllmEngine: the task's bounded JSON Schema, the default loop guard, greedy) and runs
each in-flight size in turn on it (waves x size rows of a bench/tasks.py task), with the step profiler on
(BATCHJSON_PROFILE_STEPS), which batchjson's vLLM plugin installs in the engine processes, so batchjson must be
installed (pip install -e .) where this runs. Prints one JSON object
(also written to --out): wall seconds, output tokens/s, acceptance, mean accepted draft tokens per request-step,
engine steps and the per-part profile (count, total s, ms per step).

--shape llama-8b replaces the model by a random-weight model of Llama-3-8B's shape (vLLM's load_format="dummy" fills
the weights; the tokenizer is --model's): it measures cost per step, not quality or acceptance. Profiling waits for
the GPU around each model-runner part (see engine/profiler.py, _cuda_sync): compare profiled runs with profiled runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from importlib.metadata import entry_points
from pathlib import Path

from batchjson.engine.profiler import DUMP_EVERY_S, ENV_PROFILE, ENV_PROFILE_SYNC, read_profile
from batchjson.records import Stage
from bench import tasks

LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 500000.0}
SHAPES = {"llama-8b": LLAMA_8B}


def speculative_config(args) -> dict | None:
    if args.method == "none":
        return None
    config = {"method": args.method, "num_speculative_tokens": args.k}
    if args.method == "ngram":
        config |= {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
    if args.method == "draft_model":
        config["model"] = args.draft_model or args.model
    return config


def _flushed(profile: Path, engine) -> dict:
    """The profile so far: the engine process writes it every DUMP_EVERY_S while it steps, so wait that long and
    step once more (one 1-token request), then read it."""
    from batchjson.records import Prompt

    time.sleep(DUMP_EVERY_S + 0.2)
    params = engine.params[Stage.FIRST]
    engine.params[Stage.FIRST] = engine._sampling(max_tokens=1, temperature=0.0)
    list(engine.stream([Prompt("flush", "flush", "{")]))
    engine.params[Stage.FIRST] = params
    return read_profile(profile)


def _delta(after: dict, before: dict) -> dict:
    parts = {}
    for name, v in after["parts"].items():
        b = before["parts"].get(name, {"count": 0, "seconds": 0.0})
        parts[name] = {"count": v["count"] - b["count"], "seconds": v["seconds"] - b["seconds"]}
    return {"steps": after["steps"] - before["steps"], "parts": parts}


def measure(args, profile: Path) -> list[dict]:
    """One engine (batchjson's VllmEngine: the product's settings, loop guard included) and one task; each in-flight
    size in turn on it, with the profile, the tokens and the draft counters taken as differences."""
    from batchjson.engine import VllmEngine
    from batchjson.records import Prompt
    from batchjson.spec import LOOP_GUARD_BOUNDED, DecodingSpec, ModelSpec, SpeculativeSpec
    from batchjson.schema.validate import Validator

    from bench.throughput import make_shape_model, model_dir

    model = model_dir(args.model)
    engine_kwargs = json.loads(args.engine)
    if args.shape:
        model = str(make_shape_model(model, Path(tempfile.gettempdir()) / f"shape-{args.shape}", SHAPES[args.shape]))
        engine_kwargs = {"load_format": "dummy", **engine_kwargs}
    sizes = [int(x) for x in args.in_flight.split(",")]
    counts = [max(args.min_prompts, args.waves * b) for b in sizes]
    schema = tasks.schema(args.task, bounded=True)
    task = tasks.TASKS[args.task]
    rows = tasks.rows(args.task, max(counts), seed=args.seed)
    spec = SpeculativeSpec(method="none") if args.method == "none" else SpeculativeSpec(
        method=args.method, num_speculative_tokens=args.k,
        draft_model=(args.draft_model or model) if args.method == "draft_model" else None)
    decoding = DecodingSpec(temperature=0.0, max_tokens=args.max_tokens, repetition_detection=dict(LOOP_GUARD_BOUNDED))
    started = time.perf_counter()
    engine = VllmEngine(ModelSpec(path=model, max_in_flight=max(sizes), engine=engine_kwargs), decoding, schema,
                        spec if spec.enabled else None)
    start_s = time.perf_counter() - started
    tok = engine.llm.get_tokenizer()
    texts = [tok.apply_chat_template([{"role": "system", "content": task["system"]},
                                      {"role": "user", "content": task["template"].format(text=text)}],
                                     tokenize=False, add_generation_prompt=True) for _, text, _ in rows]
    validator = Validator(schema)
    out = []
    for size, count in zip(sizes, counts):
        engine.max_in_flight = size
        before, stats0 = _flushed(profile, engine), engine.stats()
        t0 = time.perf_counter()
        gens = list(engine.stream(Prompt(str(i), "u", texts[i]) for i in range(count)))
        wall = time.perf_counter() - t0
        prof, stats = _delta(_flushed(profile, engine), before), engine.stats()
        drafts, drafted, accepted = (stats[k] - stats0[k] for k in ("drafts", "draft_tokens", "accepted_tokens"))
        tokens = sum(g.output_tokens for g in gens)
        valid = sum(validator.check(g).ok for g in gens)
        steps = prof["steps"] or 1
        out.append({"method": args.method, "k": args.k if spec.enabled else 0, "shape": args.shape or "", "task": args.task,
                    "in_flight": size, "rows": count, "wall_s": round(wall, 3),
                    "output_tokens": tokens, "output_tokens_per_s": round(tokens / wall, 1), "valid": valid,
                    "acceptance": round(accepted / drafted, 3) if drafted else None,
                    "accepted_per_draft": round(accepted / drafts, 3) if drafts else None,
                    "steps": prof["steps"], "ms_per_step": round(1000 * wall / steps, 3),
                    "tokens_per_step": round(tokens / steps, 2), "engine_start_s": round(start_s, 1),
                    "texts_sha": hashlib.sha256("\n".join(g.text for g in gens).encode()).hexdigest()[:16],
                    "parts_ms_per_step": {k: round(1000 * v["seconds"] / steps, 3)
                                          for k, v in sorted(prof["parts"].items(), key=lambda kv: -kv[1]["seconds"])}})
        print(json.dumps({k: v for k, v in out[-1].items() if k != "parts_ms_per_step"}), flush=True)
    engine.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench spec-profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help='model folder, or "default" (the embedded SmolLM2)')
    ap.add_argument("--method", default="ngram", help="none, ngram, suffix, draft_model, ...")
    ap.add_argument("--draft-model", help="draft folder for draft_model (default: --model itself)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--in-flight", default="32", help="in-flight sizes to sweep on one engine, e.g. 1,8,32,128,512")
    ap.add_argument("--waves", type=int, default=3, help="rows per size = waves x in flight (at least --min-prompts)")
    ap.add_argument("--min-prompts", type=int, default=16)
    ap.add_argument("--task", default="A", choices=sorted(tasks.TASKS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a random-weight model of this shape instead of --model")
    ap.add_argument("--profile-sync", choices=("on", "off"), default="on",
                    help="wait for the GPU around model-runner parts (on: per-part times are real, overlap is lost)")
    ap.add_argument("--engine", default="{}", help="other vllm.LLM arguments, as JSON")
    ap.add_argument("--out", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    if not any(ep.value.startswith("batchjson.") for ep in entry_points(group="vllm.general_plugins")):
        sys.exit("batchjson's vLLM plugin is not installed here (its entry point installs the profiler): "
                 "pip install --no-deps -e .")
    profile = Path(tempfile.mkdtemp(prefix="spec-profile-")) / "profile.json"
    os.environ.update({"BATCHJSON_RUNNER_PID": str(os.getpid()), ENV_PROFILE: str(profile),
                       ENV_PROFILE_SYNC: "1" if args.profile_sync == "on" else "0"})
    try:
        sizes, error = measure(args, profile), None
    except Exception as e:  # still write what the profile file says (an install error, the patches)
        import traceback

        traceback.print_exc()
        sizes, error = [], f"{type(e).__name__}: {e}"
    try:
        prof = read_profile(profile)
    except (OSError, ValueError, KeyError) as e:
        prof = {"patches": {}, "errors": [f"no profile file {profile}: {e}"]}
    result = {"settings": {k: str(v) for k, v in vars(args).items()}, "sizes": sizes,
              "patches": prof["patches"], "profile_errors": prof["errors"]}
    if error:
        result["error"] = error
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if error:
        sys.exit(f"spec_profile: {error}")
    return 0


if __name__ == "__main__":  # bench/gpu/profile_session.sh runs this file by its path, with the tree on PYTHONPATH
    sys.exit(main())
