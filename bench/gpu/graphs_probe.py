"""What CUDA graphs at vLLM's full batch buy, with no model to carry: a Qwen2.5-Coder-1.5B-shaped model with random
weights (vLLM's load_format "dummy"; no tokenizer, prompts as token ids), N prompts of L tokens each answering T
tokens (ignore_eos), vLLM's full batch (max_num_seqs 1,024), greedy, no grammar. vLLM 0.26 captures graphs for steps
of up to min(2 x max_num_seqs, 512) tokens, fewer than such a step holds; `cgN` captures them up to N tokens
(batchjson/engine/vllm_engine.py graph_sizes). Each configuration in its own process, in the order given:

    python3 bench/gpu/graphs_probe.py OUT default,cg2048,default,cg2048 [--rows 3000 --prompt 600 --tokens 48]

Writes OUT/graphs-<i>-<config>.json (engine start s, generate s, output tokens) and prints each line.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

QWEN15 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536,
          "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
          "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
          "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 151643,
          "eos_token_id": 151645, "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 28}


def one(cfg: dict) -> dict:
    import vllm
    from vllm.inputs import TokensPrompt

    from batchjson.engine.vllm_engine import graph_sizes

    kwargs = dict(model=cfg["model"], load_format="dummy", skip_tokenizer_init=True, max_num_seqs=1024,
                  max_model_len=cfg["prompt"] + cfg["tokens"] + 16, seed=0)
    sizes = graph_sizes(int(cfg["name"][2:])) if cfg["name"].startswith("cg") else None
    if sizes:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": sizes}
    began = time.perf_counter()
    llm = vllm.LLM(**kwargs)
    started = time.perf_counter() - began
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(1000, 150000) for _ in range(cfg["prompt"])])
               for _ in range(cfg["rows"])]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=cfg["tokens"], ignore_eos=True, detokenize=False)
    began = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - began
    llm.llm_engine.engine_core.shutdown()
    return {"name": cfg["name"], "engine_start_s": round(started, 1), "generate_s": round(seconds, 2),
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "max_capture": sizes[-1] if sizes else "vLLM's"}


def main() -> int:
    if sys.argv[1:2] == ["_one"]:
        cfg = json.loads(sys.argv[2])
        Path(cfg["result"]).write_text(json.dumps(one(cfg)))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("configs")
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--prompt", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--timeout", type=float, default=240)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "qwen15-shape"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN15))
    for i, name in enumerate(args.configs.split(",")):
        cfg = {"name": name, "model": str(model), "rows": args.rows, "prompt": args.prompt, "tokens": args.tokens,
               "result": str(args.out / f"graphs-{i}-{name}.json")}
        with open(args.out / f"graphs-{i}-{name}.log", "w") as log:
            rc = subprocess.run([sys.executable, __file__, "_one", json.dumps(cfg)], stdout=log, stderr=log,
                                timeout=args.timeout).returncode
        result = Path(cfg["result"])
        print(result.read_text() if result.exists() else json.dumps({"name": name, "error": f"rc {rc}"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
