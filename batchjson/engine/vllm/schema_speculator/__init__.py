"""`[speculative] method = "schema"` on vLLM's Model Runner V2: batchjson's drafter (what each request's grammar
forces next, else a copy from its prompt: schema/drafts.py) as a speculative method registered with vLLM's
`register_speculative_method` (vLLM 0.34; experimental there). Where vLLM has no such registry, the method runs
through engine/vllm/drafts.py's custom_class path (vLLM 0.26 and 0.32), as before.

Where the drafts are made. On MRv2 the speculator runs in the GPU worker, right after a step's tokens are sampled,
and its drafts go straight into the runner's draft buffer on the GPU (the scheduler, which holds vLLM's own
grammar matchers, sees them only afterwards, to fill the masks). So the speculator keeps its own xgrammar matcher
per request, of the job's grammar (given in `speculator_options`, compiled once in the worker), and advances it
through the tokens each step added (steps.py). Its cost per step: one copy of each request's last k + 1 tokens to
the host (which waits for the step's sampling: the drafts depend on its tokens), an accept per new token and a
`find_jump_forward_string` per request in Python, and one k-wide row per request back to the GPU. A prompt is read
once per request.

Exactness: the drafts are proposals, verified by the target under the grammar's masks (MRv2's rejection sampler),
so greedy outputs stay token-identical to decoding without drafts. A request whose grammar is not the job's gets
copies only; a position with nothing known gets the end token (steps.py says why; MRv2 verifies k positions a
request anyway).

config.py (the SpeculatorConfig, imported in every vLLM process) and speculator.py (the speculator, imported in
the worker only) need vLLM 0.34; this module and steps.py import no vLLM. Read on (0.34.0):
vllm/v1/worker/gpu/spec_decode/speculator_config.py (register_speculative_method(name, config class path),
SpeculatorConfig) and vllm/config/speculative.py (speculator_options).
"""

from __future__ import annotations

import importlib.util
import json

METHOD = "batchjson_schema"  # the name it is registered under (a vLLM method name; batchjson's job file says "schema")
CONFIG = "batchjson.engine.vllm.schema_speculator.config.SchemaSpeculatorConfig"
REGISTRY = "vllm.v1.worker.gpu.spec_decode.speculator_config"


def register() -> bool:
    """Register the method with this process's vLLM where it has the registry (idempotent); whether it is
    registered. vLLM resolves CONFIG only when an engine asks for the method."""
    try:
        if importlib.util.find_spec(REGISTRY) is None:
            return False
    except ModuleNotFoundError:  # no vLLM, or one without Model Runner V2
        return False
    registry = importlib.import_module(REGISTRY)
    if not hasattr(registry, "register_speculative_method"):
        return False
    registry.register_speculative_method(METHOD, CONFIG)
    return True


def speculative_config(num_speculative_tokens: int, schema: dict | None, options: dict) -> dict:
    """vLLM's speculative_config for the registered method: `schema` is the grammar's JSON Schema as vLLM's
    structured outputs get it (None: any JSON object); `options` (the job's [speculative.options]) go last."""
    return {"method": METHOD, "num_speculative_tokens": num_speculative_tokens,
            "speculator_options": {"json_schema": None if schema is None else json.dumps(schema)}} | options
