"""The schema drafter's SpeculatorConfig (vLLM 0.34's Model Runner V2): no draft model, the target's vocabulary, and
the job's grammar in `speculator_options` ({"json_schema": a JSON Schema's text, or None for any JSON object}).
Imported by vLLM in each of its processes when an engine asks for the method; it imports no speculator. Read on
vLLM 0.34.0: vllm/v1/worker/gpu/spec_decode/speculator_config.py (SpeculatorConfig: speculator_class,
supported_options, adaptive_verification_uses_draft_logits, configure, apply_options)."""

from __future__ import annotations

from vllm.v1.worker.gpu.spec_decode.speculator_config import SpeculatorConfig


class SchemaSpeculatorConfig(SpeculatorConfig):
    speculator_class = "batchjson.engine.vllm.schema_speculator.speculator.SchemaSpeculator"
    supported_options = frozenset({"speculator_options"})
    adaptive_verification_uses_draft_logits = False  # there are no draft logits

    @classmethod
    def configure(cls, spec) -> None:
        super().configure(spec)  # no draft model: the target's config gives the vocabulary
        if spec.num_speculative_tokens is None:
            raise ValueError("the schema drafter needs num_speculative_tokens")

    @classmethod
    def apply_options(cls, spec) -> None:
        options = spec.speculator_options or {}
        unknown = set(options) - {"json_schema"}
        if unknown:
            raise ValueError(f"the schema drafter's speculator_options take json_schema only, not {sorted(unknown)}")
