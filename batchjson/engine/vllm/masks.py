"""The masks placed on the GPU with drafts (the V1 model runner only). Once speculation is on, vLLM 0.26 decodes with
its V1 model runner, whose apply_grammar_bitmask copies the step's mask into a fresh pinned tensor one row at a time
in Python (9,216 rows at 1,024 requests with k = 8: 37 ms of CPU a step on the H200 host). `install_mask_scatter`
copies the compact mask once and scatters its rows on the GPU (mask_rows, apply_mask_rows: 0.6 ms), as Model Runner
V2 does without drafts; the CPU runner keeps vLLM's own.
"""

from __future__ import annotations

import functools

from batchjson.engine.vllm.versions import installs_once, unread_here

# Read on (mask_scatter, 0.26 and 0.32): vllm/v1/structured_output/utils.py. apply_grammar_bitmask(scheduler_output,
# grammar_output, input_batch, logits), imported by name into vllm/v1/worker/gpu_model_runner.py, masks the logits
# before sampling in the V1 GPU model runner, which vLLM 0.26 decodes with once speculation is on (Model Runner V2
# without it copies the compact mask once and scatters it on the GPU). Its rows: grammar_output.grammar_bitmask holds
# each request of structured_output_request_ids in turn, 1 + its scheduled drafts rows; a request's first logit row
# is its index in input_batch.req_ids plus the drafts of the requests before it; requests not in the batch are
# skipped. It builds a (logit rows x words) pinned tensor of -1 every step, copies the rows into it one at a time in
# Python and copies it all to the GPU: at 1,024 requests with k = 8, 9,216 rows and 175 MB a step.


def mask_rows(req_ids, grammar_ids, spec_tokens):
    """Where apply_grammar_bitmask puts the compact mask's rows: (the rows kept, None for all of them; the logit row
    of each kept row), as int32 arrays. One Python step per request, not per row."""
    import numpy as np

    first, offset = {}, 0
    for index, req_id in enumerate(req_ids):
        first[req_id] = index + offset
        offset += len(spec_tokens.get(req_id, ()))
    n = len(grammar_ids)
    counts = np.fromiter((1 + len(spec_tokens.get(r, ())) for r in grammar_ids), np.int64, n)
    starts = np.fromiter((first.get(r, -1) for r in grammar_ids), np.int64, n)
    ends = np.cumsum(counts)
    position = np.arange(int(ends[-1]) if n else 0) - np.repeat(ends - counts, counts)
    logit_rows = (np.repeat(starts, counts) + position).astype(np.int32)
    if (starts >= 0).all():
        return None, logit_rows
    kept = np.repeat(starts >= 0, counts)
    return np.flatnonzero(kept).astype(np.int32), logit_rows[kept]


def apply_mask_rows(grammar_bitmask, kept, logit_rows, logits) -> None:
    """Mask `logits` in place with the compact mask's rows (mask_rows' answer): one copy of the mask to the logits'
    device (from pinned memory where the fills left it there: BatchFills), its rows scattered to their logit rows
    there, xgrammar's kernel on those rows alone. Any device; the engine uses it where the logits are on a GPU."""
    import torch
    import xgrammar as xgr

    if not len(logit_rows):
        return
    device = logits.device
    on_gpu = device.type != "cpu"

    def to_device(array):
        tensor = torch.from_numpy(array)
        if on_gpu and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=True)

    rows, targets = to_device(grammar_bitmask), to_device(logit_rows)
    if kept is not None:
        rows = rows[to_device(kept).long()]
    placed = torch.empty((logits.shape[0], rows.shape[1]), dtype=rows.dtype, device=device)
    placed.index_copy_(0, targets.long(), rows)
    xgr.apply_token_bitmask_inplace(logits, placed, indices=targets if on_gpu else logit_rows.tolist())


@installs_once
def install_mask_scatter() -> str:
    """Patch the V1 GPU model runner's apply_grammar_bitmask (in this process) to place the rows on the GPU
    (mask_rows, apply_mask_rows) where the logits are there; vLLM's own where they are not (the CPU runner). "ok" or
    why not (then vLLM's own runs)."""
    import inspect

    if why := unread_here("mask_scatter"):
        return why
    from vllm.v1.structured_output import utils
    from vllm.v1.worker import gpu_model_runner

    own = utils.apply_grammar_bitmask
    if gpu_model_runner.apply_grammar_bitmask is not own or list(inspect.signature(own).parameters) != [
            "scheduler_output", "grammar_output", "input_batch", "logits"]:
        return "apply_grammar_bitmask changed"

    @functools.wraps(own)
    def apply_grammar_bitmask(scheduler_output, grammar_output, input_batch, logits):
        if logits.is_cpu:
            return own(scheduler_output, grammar_output, input_batch, logits)
        kept, logit_rows = mask_rows(input_batch.req_ids, grammar_output.structured_output_request_ids,
                                     scheduler_output.scheduled_spec_decode_tokens)
        apply_mask_rows(grammar_output.grammar_bitmask, kept, logit_rows, logits)

    gpu_model_runner.apply_grammar_bitmask = apply_grammar_bitmask
    return "ok"
