"""The grammar's masks in one call a step: BatchFills, and the patch that makes vLLM's StructuredOutputManager fill
through it.

vLLM fills a step's grammar masks with a Python call per row (on a pool of threads that take turns at the GIL
between rows; serially with drafts). `install_batch_fills` replaces StructuredOutputManager.grammar_bitmask with
BatchFills: the same rows from one call to xgrammar's batch matcher (C++ threads), into pinned buffers the GPU runner
copies as they are (H200, the 1.5B at 1,024 in flight: 62.4-71.2 ms a step against vLLM's 81.4-98.8; BENCHMARKS.md,
"What the JSON constraint costs a step"); on vLLM 0.34, in its layout of k + 1 rows a request where the engine drafts
k (LAYOUTS["strided_fills"]). A step with drafts is filled here only on the versions of PATCHES["drafted_fills"].
`[model] grammar_fills = "vllm"` (GRAMMAR_FILLS_ENV) keeps vLLM's fills.
"""

from __future__ import annotations

import functools
import itertools
import os

from batchjson.engine.vllm.versions import installs_once, layout, unread_here

# Read on (batch_fills, drafted_fills): vllm/v1/structured_output/__init__.py.
# StructuredOutputManager.grammar_bitmask(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens)
# returns one int32 row (vocab/32 words) per request and position, in the order of the ids (a request's k drafted
# positions, then its bonus position), as a numpy view of a tensor it keeps; a request whose grammar is terminated, or a
# position it does not constrain, gets -1 (every token allowed). Without a reasoning parser every row of a request is
# constrained. Its grammars are backend_xgrammar.XgrammarGrammar (`matcher`, an xgrammar GrammarMatcher;
# `is_terminated()`), advanced and rolled back around the drafted positions. 0.26 and 0.32 differ only with drafts:
# after a -1 draft (padding), 0.26 fills the bonus row from the grammar and 0.32 leaves it -1; a draft the grammar
# rejects raises in 0.26 and makes 0.32 copy the last row into the rest. So the drafted path here is 0.26's, and on 0.32
# a step with drafts takes vLLM's own. 0.34 (its __init__.py, backend_xgrammar.py, and Model Runner V2's
# structured_outputs.py): where the engine drafts (vllm_config.num_speculative_tokens = k > 0), each request owns a
# block of mask_stride = k + 1 rows, from i * (k + 1), whether or not it has drafts this step; rows past its own are
# left as they were (the runner's kernel masks only the positions a request has logits for). Without k, one row per
# request, as before. In a block: each drafted position's row, then the bonus row, from the grammar advanced through the
# drafts before it; once a draft is -1 (padding), refused by the grammar, or the grammar has ended, every later row of
# the block is -1, and the grammar is rolled back at the end. Under async scheduling the drafts are the drafter's
# unchecked ones (update_draft_token_ids_in_output pads them with -1), so refusals happen there and are not errors.
GRAMMAR_FILLS_ENV = "BATCHJSON_GRAMMAR_FILLS"  # "batch" (the default) or "vllm": set by VllmEngine from the spec
MASK_BUFFERS = 3  # a buffer is filled again 3 steps later: vLLM keeps at most 2 steps in flight (its batch queue)


FILL_THREADS_ENV = "BATCHJSON_FILL_THREADS"  # a count of xgrammar's fill threads (the benchmarks' comparisons)


def fill_threads() -> int:
    """xgrammar's threads for one engine's fills: vLLM's own count, min(cores/2, 8), of the cores this process may
    use (an engine replica's share of the host), unless FILL_THREADS_ENV gives one."""
    given = os.environ.get(FILL_THREADS_ENV, "")
    return int(given) if given.isdigit() and int(given) > 0 else max(1, min(len(os.sched_getaffinity(0)) // 2, 8))


class BatchFills:
    """One step's grammar masks through xgrammar's BatchGrammarMatcher: one call fills every row of a position in
    C++ threads, where vLLM makes a Python call per row (in 16-row tasks on a thread pool without drafts, serially
    with them), then advances each matcher through its drafts with one call per position and rolls them back with
    one. Rows and values are vLLM's own (see the Read on note above). The mask is written into one of MASK_BUFFERS
    buffers in pinned memory where this process runs the GPU model runner, so the runner copies it to the GPU as it is,
    without first copying it into pinned memory of its own (19.4 MB a step at 1,024 rows of a 151,936-token
    vocabulary)."""

    def __init__(self, rows: int, words: int, drafted: bool, pinned: bool = False, stride: int = 0):
        import torch
        import xgrammar as xgr

        self.buffers = [torch.empty((rows, words), dtype=torch.int32, pin_memory=pinned) for _ in range(MASK_BUFFERS)]
        self.turn = 0
        self.drafted = drafted  # this vLLM's drafted path is the one read (PATCHES["drafted_fills"])
        self.stride = stride  # rows a request owns (vLLM 0.34: k + 1), or 0: a row per position, packed (0.26)
        self.batch = xgr.BatchGrammarMatcher(fill_threads())
        self.xgr = xgr
        core = getattr(getattr(xgr, "base", None), "_core", None)  # xgrammar's FFI module (0.2.8, 0.2.9)
        self.core = core if hasattr(getattr(core, "BatchGrammarMatcher", None), "batch_accept_token") else None
        self.finds_refusals = self.core is not None and self._finds_refusals()

    @classmethod
    def for_manager(cls, manager, drafted: bool) -> "BatchFills":
        """For a StructuredOutputManager: rows for its batch and drafts, in pinned memory where this process runs the
        GPU model runner (the one-GPU engine core does)."""
        import torch

        config = manager.vllm_config
        k = (config.speculative_config.num_speculative_tokens if config.speculative_config else 0) or 0
        words = manager.backend.allocate_token_bitmask(1).shape[1]
        pinned = torch.cuda.is_available() and torch.cuda.is_initialized()
        stride = 1 + k if k and layout("strided_fills") else 0
        return cls(config.scheduler_config.max_num_seqs * (1 + k), words, drafted, pinned, stride)

    def bitmask(self, requests, ids, drafts):
        """vLLM's grammar_bitmask for these requests, or None where this step is vLLM's own (drafts on an unread
        vLLM)."""
        if drafts and any(drafts.get(r) for r in ids):
            return self._drafted(requests, ids, drafts) if self.drafted else None
        grammars = [requests[r].structured_output_request.grammar for r in ids]
        if self.stride:  # the first row of each request's block
            return self.fill(grammars, self._next(), range(0, len(ids) * self.stride, self.stride))[
                :len(ids) * self.stride].numpy()
        return self.fill(grammars)[:len(ids)].numpy()

    def accept(self, matchers, tokens):
        """xgrammar's batch accept of one token each: truthy where accepted, in order. Its wrapper reads the answer
        (an FFI array) an element at a time in Python, each read an FFI call that lets the interpreter's lock go and
        waits to take it back beside the forward's launch; here one FFI call asks whether any was refused (0 in
        the answer) and the answer is read only then, where xgrammar's FFI module is there and answers as read."""
        if self.core is None or not all(hasattr(m, "_handle") for m in matchers[:1]):
            return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        answer = self.core.BatchGrammarMatcher.batch_accept_token([m._handle for m in matchers], tokens, False)
        if self.finds_refusals and 0 not in answer:
            return itertools.repeat(True, len(matchers))
        return answer[:]

    def _finds_refusals(self) -> bool:
        """Whether `0 in answer` finds the refused tokens of this xgrammar's batch accept, tried once on a grammar of
        a two-token vocabulary: "}" refused and "{" taken at a JSON value's start."""
        xgr, core = self.xgr, self.core
        try:
            compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(["{", "}"])).compile_builtin_json_grammar()
            matchers = [xgr.GrammarMatcher(compiled) for _ in range(2)]
            both = core.BatchGrammarMatcher.batch_accept_token([m._handle for m in matchers], [0, 1], False)
            taken = core.BatchGrammarMatcher.batch_accept_token([matchers[1]._handle], [0], False)
            return [bool(ok) for ok in both[:]] == [True, False] and 0 in both and 0 not in taken
        except Exception:  # noqa: BLE001 - an xgrammar that answers otherwise: its answers are read in full
            return False

    def fill_rows(self, matchers, rows, ended, mask=None):
        """`mask` (default the next buffer) with `matchers`' masks at `rows` and -1 at `ended` (rows of ended grammars;
        through numpy: torch's indexed write runs its own threads on a CPU)."""
        if mask is None:
            mask = self._next()
        if ended:
            mask.numpy()[ended] = -1
        if matchers:
            self.batch.batch_fill_next_token_bitmask(matchers, mask, rows)
        return mask

    def fill(self, grammars, mask=None, rows=None):
        """The masks of `grammars` (vLLM's XgrammarGrammar) in the next buffer, a row each in order, or into `mask`
        at `rows`: -1 for a terminated grammar, as vLLM fills. Returns the buffer."""
        if mask is None:
            mask, rows = self._next(), range(len(grammars))
        matchers, at, ended = [], [], []
        for row, grammar in zip(rows, grammars):
            if grammar.is_terminated():
                ended.append(row)
            else:
                matchers.append(grammar.matcher)
                at.append(row)
        return self.fill_rows(matchers, at, ended, mask)

    def _next(self):
        mask = self.buffers[self.turn]
        self.turn = (self.turn + 1) % MASK_BUFFERS
        return mask

    def _drafted(self, requests, ids, drafts):
        """vLLM's rows with drafts: for each request, a row per drafted position filled from the grammar
        advanced through the drafts before it, then the bonus row; a terminated grammar's rows are -1; the grammar is
        rolled back at the end. After a -1 draft the grammar stays and the drafted rows are -1; vLLM 0.26 fills the
        bonus row (and raises at a refused draft), 0.34 (`stride`) makes the rest of the block -1 after a -1 draft
        or a refused one, and places each request's rows at its block of `stride`."""
        mask = self._next()
        grammars = [requests[r].structured_output_request.grammar for r in ids]
        tokens = [drafts.get(r, ()) for r in ids]
        first, row = [], 0
        for t in tokens:
            first.append(row)
            row += self.stride or len(t) + 1
        total = row
        ended = [g.is_terminated() for g in grammars]
        applying = [True] * len(ids)
        advanced = [0] * len(ids)
        unconstrained: list[int] = []
        live = list(range(len(ids)))
        position = 0
        while live:
            matchers, rows, movers, moves = [], [], [], []
            for i in live:
                t, at = tokens[i], first[i] + position
                bonus = position == len(t)
                if ((bonus and not self.stride) or applying[i]) and not ended[i]:
                    matchers.append(grammars[i].matcher)
                    rows.append(at)
                else:
                    unconstrained.append(at)
                if bonus:
                    continue
                if t[position] == -1:
                    applying[i] = False
                elif applying[i] and not ended[i]:
                    movers.append(i)
                    moves.append(t[position])
            if matchers:
                self.batch.batch_fill_next_token_bitmask(matchers, mask, rows)
            if movers:
                moved = [grammars[i].matcher for i in movers]
                accepted = self.accept(moved, moves)
                for i, token, ok in zip(movers, moves, accepted):
                    if not ok and self.stride:  # 0.34: the rest of the block is -1
                        applying[i] = False
                        continue
                    if not ok:  # vLLM 0.26 raises the same (the scheduler validated every draft before)
                        raise AssertionError((token, ids[i], drafts))
                    advanced[i] += 1
                    ended[i] = grammars[i].matcher.is_terminated()
            position += 1
            live = [i for i in live if len(tokens[i]) >= position]
        if unconstrained:
            mask.numpy()[unconstrained] = -1
        back = [i for i in range(len(ids)) if advanced[i]]
        if back:
            self.xgr.BatchGrammarMatcher.batch_rollback([grammars[i].matcher for i in back],
                                                        [advanced[i] for i in back])
        return mask[:total].numpy()


def fills_wanted() -> bool:
    """Whether this process's engines fill through BatchFills: unless the run set grammar_fills = "vllm"."""
    return os.environ.get(GRAMMAR_FILLS_ENV, "batch") != "vllm"


def batch_fills_unready() -> str:
    """Why BatchFills cannot serve this vLLM and xgrammar ("" where it can)."""
    import inspect

    if why := unread_here("batch_fills"):
        return why
    import xgrammar as xgr
    from vllm.v1.structured_output import StructuredOutputManager

    if list(inspect.signature(StructuredOutputManager.grammar_bitmask).parameters) != [
            "self", "requests", "structured_output_request_ids", "scheduled_spec_decode_tokens"]:
        return "StructuredOutputManager.grammar_bitmask changed"
    if not all(hasattr(xgr.BatchGrammarMatcher, name) for name in (
            "batch_fill_next_token_bitmask", "batch_accept_token", "batch_rollback")):
        return "this xgrammar has no BatchGrammarMatcher with batch fills, accepts and rollbacks"
    return ""


def fills_for(manager):
    """A StructuredOutputManager's BatchFills, made at its first fill; False where its grammars are not ours to fill
    (another backend, a reasoning parser, a diffusion model)."""
    fills = manager.__dict__.get("_batchjson_fills")
    if fills is None:
        from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

        ours = (isinstance(manager.backend, XgrammarBackend) and manager.reasoner_cls is None
                and not getattr(manager.vllm_config.model_config, "is_diffusion", False))
        fills = BatchFills.for_manager(manager, not unread_here("drafted_fills")) if ours else False
        manager.__dict__["_batchjson_fills"] = fills
    return fills


@installs_once
def install_batch_fills() -> str:
    """Patch StructuredOutputManager.grammar_bitmask (in this process) to fill through BatchFills where the grammars
    are xgrammar's and no reasoning parser gates them; vLLM's own fill everywhere else. "ok" or why not (then
    vLLM's fills run). Installed unless the run set grammar_fills = "vllm" (fills_wanted)."""
    if why := batch_fills_unready():
        return why
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend, XgrammarGrammar

    own = StructuredOutputManager.grammar_bitmask

    @functools.wraps(own)
    def grammar_bitmask(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens):
        fills = fills_for(self) if structured_output_request_ids else False
        if fills:
            grammar = requests[structured_output_request_ids[0]].structured_output_request.grammar
            if isinstance(grammar, XgrammarGrammar):
                mask = fills.bitmask(requests, structured_output_request_ids, scheduled_spec_decode_tokens)
                if mask is not None:
                    return mask
        return own(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens)

    StructuredOutputManager.grammar_bitmask = grammar_bitmask
    return "ok"

