"""Where a speculative step's time goes under a JSON-schema grammar: one method, one in-flight size, one run.

    python bench/spec_profile.py --model /tmp/models/smollm2 --method ngram --in-flight 128 --parallel on
    python bench/spec_profile.py --model /tmp/models/smollm2 --method ngram --in-flight 128 --parallel off
    python bench/spec_profile.py --model /tmp/models/smollm2 --shape llama-8b --method ngram --in-flight 32

Runs --prompts rows of a bench/tasks.py task (default 2 x in flight) through a bare vllm.LLM with the task's JSON
Schema (xgrammar, whitespace disabled, greedy), with the step profiler on (BATCHJSON_PROFILE_STEPS) and the
parallel grammar bitmask on or off (BATCHJSON_PARALLEL_BITMASK): both are installed by batchjson's vLLM plugin in
the engine processes, so batchjson must be installed (pip install -e .) where this runs. Prints one JSON object
(also written to --out): wall seconds, output tokens/s, acceptance, mean accepted draft tokens per request-step,
engine steps and the per-part profile (count, total s, ms per step).

--shape llama-8b replaces the model by a random-weight model of Llama-3-8B's shape (vLLM's load_format="dummy" fills
the weights; the tokenizer is --model's): it measures cost per step, not quality or acceptance. Profiling waits for
the GPU around each model-runner part (see vllm_patches._cuda_sync): compare profiled runs with profiled runs.
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

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import tasks  # noqa: E402
from batchjson.vllm_patches import ENV_PARALLEL, ENV_PROFILE, ENV_PROFILE_SYNC, read_profile  # noqa: E402

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


def measure(args) -> dict:
    import vllm
    from vllm.sampling_params import StructuredOutputsParams

    from bench import make_shape_model, _model

    model = _model(args.model)
    engine = json.loads(args.engine)
    if args.shape:
        model = str(make_shape_model(model, Path(tempfile.gettempdir()) / f"shape-{args.shape}", SHAPES[args.shape]))
        engine = {"load_format": "dummy", **engine}
    rows = tasks.rows(args.task, args.prompts or 2 * args.in_flight, seed=args.seed)
    task = tasks.TASKS[args.task]
    kwargs = dict(model=model, max_num_seqs=args.in_flight, disable_log_stats=False, seed=0,
                  structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
    if speculative_config(args):
        kwargs["speculative_config"] = speculative_config(args)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        kwargs["enforce_eager"] = True
    kwargs |= engine
    llm = vllm.LLM(**kwargs)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "system", "content": task["system"]},
                                        {"role": "user", "content": task["template"].format(text=text)}],
                                       tokenize=False, add_generation_prompt=True) for _, text, _ in rows]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=tasks.schema(args.task)))
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    llm.llm_engine.engine_core.shutdown()  # the engine process writes its last profile numbers
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafts = metrics.get("vllm:spec_decode_num_drafts", 0)
    drafted = metrics.get("vllm:spec_decode_num_draft_tokens", 0)
    accepted = metrics.get("vllm:spec_decode_num_accepted_tokens", 0)
    return {"wall_s": wall, "rows": len(outs), "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "acceptance": accepted / drafted if drafted else None,
            "accepted_per_request_step": accepted / drafts if drafts else None,
            "texts_sha": hashlib.sha256("\n".join(o.outputs[0].text for o in outs).encode()).hexdigest()[:16]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help='model folder, or "default" (the embedded SmolLM2)')
    ap.add_argument("--method", default="ngram", help="none, ngram, suffix, draft_model, ...")
    ap.add_argument("--draft-model", help="draft folder for draft_model (default: --model itself)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--in-flight", type=int, default=32, help="max_num_seqs: requests in the engine at once")
    ap.add_argument("--prompts", type=int, default=0, help="rows to run (default: 2 x in flight)")
    ap.add_argument("--task", default="A", choices=sorted(tasks.TASKS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--parallel", choices=("on", "off", "check"), default="on",
                    help="the parallel grammar bitmask (check: also run vLLM's own each step and count differences)")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a random-weight model of this shape instead of --model")
    ap.add_argument("--profile-sync", choices=("on", "off"), default="on",
                    help="wait for the GPU around model-runner parts (on: per-part times are real, overlap is lost)")
    ap.add_argument("--engine", default="{}", help="other vllm.LLM arguments, as JSON")
    ap.add_argument("--out", type=Path, help="also write the result here")
    args = ap.parse_args()
    if not any(ep.value.startswith("batchjson.") for ep in entry_points(group="vllm.general_plugins")):
        sys.exit("batchjson's vLLM plugin is not installed here (its entry point installs the profiler): "
                 "pip install --no-deps -e .")
    profile = Path(tempfile.mkdtemp(prefix="spec-profile-")) / "profile.json"
    os.environ.update({"BATCHJSON_RUNNER_PID": str(os.getpid()), ENV_PROFILE: str(profile),
                       ENV_PARALLEL: {"on": "1", "off": "0", "check": "check"}[args.parallel],
                       ENV_PROFILE_SYNC: "1" if args.profile_sync == "on" else "0"})
    result = measure(args)
    prof = read_profile(profile)
    steps = prof["steps"] or 1
    result |= {"settings": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out or "")},
               "steps": prof["steps"], "output_tokens_per_step": result["output_tokens"] / steps,
               "parallel_bitmask": prof["parallel_bitmask"],
               "parts": {k: v | {"ms_per_step": 1000 * v["seconds"] / steps}
                         for k, v in sorted(prof["parts"].items(), key=lambda kv: -kv[1]["seconds"])}}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
