"""The schema drafter as a Model Runner V2 speculator (vLLM 0.34's BaseSpeculator), in the GPU worker: vLLM calls
`propose` right after a step's tokens are sampled and its request states updated (token ids, lengths), and copies
the k-wide drafts it returns into the runner's draft buffer. The work is steps.py's; this file reads vLLM's buffers
and writes the drafts back. Read on vLLM 0.34.0: vllm/v1/worker/gpu/spec_decode/{speculator,__init__}.py,
ngram/speculator.py (the same inputs and output), states.py (RequestState) and model_runner.py (its calls)."""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

from batchjson.engine.vllm.schema_speculator.steps import StepDrafts, read_rows, read_step

log = logging.getLogger(__name__)


def compile_grammar(vllm_config, tokenizer, schema: str | None):
    """The job's grammar as vLLM's xgrammar backend compiles it (its whitespace settings; any JSON object where
    `schema` is None); None, with a warning, where xgrammar cannot: the drafter then copies only."""
    import xgrammar as xgr

    no_space = vllm_config.structured_outputs_config.disable_any_whitespace
    try:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vllm_config.model_config.get_vocab_size())
        return xgr.GrammarCompiler(info).compile_json_schema(
            schema or '{"type": "object"}', any_whitespace=not no_space, separators=(",", ":") if no_space else None)
    except Exception as e:  # noqa: BLE001 - drafts are an optimisation: never a failed start
        log.warning("the schema drafter proposes copies only: xgrammar cannot compile the job's grammar (%s)", e)
        return None


class SchemaSpeculator(BaseSpeculator):
    def __init__(self, vllm_config, device: torch.device, req_states):
        from vllm.tokenizers import cached_tokenizer_from_config

        spec = vllm_config.speculative_config
        self.k = spec.num_speculative_tokens
        self.req_states = req_states
        tokenizer = cached_tokenizer_from_config(model_config=vllm_config.model_config)
        schema = (spec.speculator_options or {}).get("json_schema")
        grammar = compile_grammar(vllm_config, tokenizer, schema if isinstance(schema, str) or schema is None
                                  else json.dumps(schema))
        self.steps = StepDrafts(lambda text: tokenizer.encode(text, add_special_tokens=False), grammar, self.k,
                                tokenizer.eos_token_id)
        rows = vllm_config.scheduler_config.max_num_seqs
        self.drafts = torch.zeros((rows, self.k), dtype=torch.int64, device=device)
        self.host = torch.zeros((rows, self.k), dtype=torch.int64, pin_memory=device.type == "cuda")
        # MRv2's adaptive verification (speculative_config enable_adaptive_verification, off by default) verifies the
        # likeliest drafts first, by these odds: a forced string's first, a filler never.
        self.enable_adaptive_verification = bool(getattr(spec, "enable_adaptive_verification", False))
        self.draft_token_confidence_probs = torch.zeros((rows, self.k), dtype=torch.float32, device=device)
        self.odds = torch.zeros((rows, self.k), dtype=torch.float32, pin_memory=device.type == "cuda")

    def init_cudagraph_manager(self, cudagraph_mode) -> None:
        pass  # no forward of its own

    def capture(self) -> None:
        pass

    def add_request(self, req_index: int) -> None:
        self.steps.add(req_index)

    def on_requests_finished(self, finished_req_ids) -> None:
        for req_id in finished_req_ids:
            slot = self.req_states.req_id_to_index.get(req_id)
            if slot is not None:
                self.steps.drop(slot)

    def reset_state(self) -> None:
        self.steps.reset()

    @torch.inference_mode()
    def propose(self, input_batch, attn_metadata: Any, slot_mappings: Any, last_hidden_states, aux_hidden_states,
                num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                dp_sync_state=None, dummy_run: bool = False, skip_attn_for_dummy_run: bool = False, mm_inputs=None,
                is_profile: bool = False, num_speculative_tokens: int | None = None) -> torch.Tensor:
        n = input_batch.num_reqs
        if dummy_run or num_speculative_tokens == 0:  # no drafts wanted: the tokens are taken at the next draft
            return self.drafts[:n]
        states, idx = self.req_states, input_batch.idx_mapping[:n]
        slots = input_batch.idx_mapping_np[:n]
        totals, sampled, tails = read_step(states.all_token_ids.gpu, states.total_len.gpu, idx, num_sampled,
                                           self.steps.window())
        prompt_lens = states.prompt_len.np[slots]
        unknown = [r for r in self.steps.unknown(slots, prompt_lens, totals) if sampled[r] > 0]
        rows = read_rows(states.all_token_ids.gpu, idx, unknown, totals)
        odds = self.odds[:n].numpy() if self.enable_adaptive_verification else None
        self.steps.draft(slots, prompt_lens, totals, sampled, tails, rows, self.host[:n].numpy(), odds)
        self.drafts[:n].copy_(self.host[:n], non_blocking=True)
        if odds is not None:
            self.draft_token_confidence_probs[:n].copy_(self.odds[:n], non_blocking=True)
        return self.drafts[:n]
