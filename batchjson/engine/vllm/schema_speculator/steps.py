"""The schema drafter's work in one step of Model Runner V2, without vLLM: each request's grammar advanced through the
tokens the step added to its output, then its draft (schema/drafts.py: the forced string's tokens, else a copy from
the prompt) written into one row of a `k`-wide array. speculator.py hands it what it read from vLLM's buffers.

A request is known by its slot (vLLM's request-state row). Its state (a matcher of the job's grammar, the output
tokens the matcher has taken, the prompt's index) is made the first step it has an output token, and forgotten when
the slot gets a new request (`add`) or its request ends (`drop`). A matcher that refuses a token the target wrote
(a grammar other than the job's) is dropped: the request then gets copies only. Drafts are proposals that the target
verifies, so nothing here can change an output token; a wrong draft costs only its verification.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from batchjson.schema.drafts import COPY_MAX, Drafter, PromptIndex


COPY_ODDS = 0.75  # a copy's tokens were accepted 68-86% of the time (BENCHMARKS.md, "The schema drafts, offline")


class Unconstrained:
    """A matcher that forces nothing: the drafter then proposes copies only."""

    @staticmethod
    def find_jump_forward_string() -> str:
        return ""


NO_GRAMMAR = Unconstrained()


class Request:
    """One request's drafting state."""

    __slots__ = ("matcher", "prompt", "seen", "tail")

    def __init__(self, matcher, prompt: Sequence[int]):
        self.matcher = matcher  # None: no grammar to follow (refused a token, or none compiled)
        self.prompt = PromptIndex(prompt)
        self.seen = 0  # output tokens taken so far
        self.tail: list[int] = []  # the last of them (copies read COPY_MAX)


class StepDrafts:
    """The drafts of every request of a step. `encode`: the tokenizer's encoding without special tokens; `grammar`:
    the job's grammar compiled by xgrammar (None: copies only); `k`: the draft's width; `end`: the end-of-text token,
    which fills the positions where nothing is known (None: the request's last token fills them).

    Why the end token: vLLM's scheduler fills a grammar mask for every drafted position up to the first one the grammar
    refuses, before the GPU verifies any, and at a full batch those masks are most of a drafted step's cost
    (BENCHMARKS.md, "Drafts at a full batch"). A grammar refuses the end token until the JSON is complete, so the
    filler stops the masks where the known draft ends; where the JSON is complete it is the right draft."""

    def __init__(self, encode: Callable[[str], list[int]], grammar, k: int, end: int | None = None):
        self.drafter = Drafter(encode, k)
        self.grammar, self.k, self.end = grammar, k, end
        self.requests: dict[int, Request] = {}

    def add(self, slot: int) -> None:
        """A request (new, or resumed after preemption) now holds `slot`: its state is made afresh."""
        self.requests.pop(slot, None)

    def drop(self, slot: int) -> None:
        self.requests.pop(slot, None)

    def reset(self) -> None:
        self.requests.clear()

    def window(self) -> int:
        """How many of each request's last tokens `draft` needs in `tails`: a step's new tokens (k + 1 at most) and
        the output's tail that copies look up."""
        return max(self.k + 1, COPY_MAX)

    def unknown(self, slots: Sequence[int], prompt_lens: Sequence[int], total_lens: Sequence[int]) -> list[int]:
        """The rows (of a step's) whose tokens `tails` cannot give: a request met for the first time (its prompt),
        or one that gained more tokens than the window since its last draft (a resumed one, a step without drafts)."""
        rows = []
        for row, (slot, prompt_len, total) in enumerate(zip(slots, prompt_lens, total_lens)):
            state = self.requests.get(int(slot))
            if state is None or total - prompt_len - state.seen > self.window():
                rows.append(row)
        return rows

    def draft(self, slots: Sequence[int], prompt_lens: Sequence[int], total_lens: Sequence[int],
              sampled: Sequence[int], tails: np.ndarray, rows: dict[int, Sequence[int]], out: np.ndarray,
              confidence: np.ndarray | None = None) -> None:
        """Write each request's draft into `out` (shape [len(slots), k]).

        Row i is the request in `slots[i]`: `prompt_lens[i]` prompt tokens, `total_lens[i]` tokens in all,
        `sampled[i]` tokens added this step (0: a prompt chunk, no draft wanted), `tails[i]` its last `window()`
        tokens (a short request's repeat its first token there: never read), `rows[i]` all its tokens, for the rows `unknown`
        named. A position with nothing to propose gets the end token, or repeats the request's last token without one
        (the target verifies it as any draft; MRv2 verifies k tokens a request in every step). `confidence` (same
        shape), where given, gets each position's odds of acceptance for MRv2's adaptive verification, which verifies
        the likeliest first: 1 for a forced string's, COPY_ODDS for a copy's, 0 for a filler."""
        width, tail_rows = tails.shape[1], tails.tolist()  # Python ints: a numpy read costs a call each
        drafts = [[row[-1] if self.end is None else self.end] * self.k for row in tail_rows]
        odds = [[0.0] * self.k for _ in tail_rows] if confidence is not None else None
        live: list[tuple[int, Request, list[int]]] = []  # (row, request, its new tokens)
        for i, (slot, prompt_len, total, n) in enumerate(zip(*(np.asarray(a).tolist() for a in (
                slots, prompt_lens, total_lens, sampled)))):
            if n <= 0:
                continue
            state = self.requests.get(slot)
            if i in rows:
                tokens = list(rows[i][:total])
                if state is None:
                    state = self.requests[slot] = Request(self._matcher(), tokens[:prompt_len])
                new = tokens[prompt_len + state.seen:]
            else:
                gained = total - prompt_len - state.seen
                new = tail_rows[i][width - gained:] if gained > 0 else []
            state.seen += len(new)
            state.tail = (state.tail + new)[-COPY_MAX:]
            live.append((i, state, new))
        advance([(state, new) for _, state, new in live])
        for i, state, _ in live:
            matcher = state.matcher
            if matcher is not None and matcher.is_terminated():
                continue
            draft, forced = self.drafter.draft(matcher or NO_GRAMMAR, state.prompt, state.tail)
            drafts[i][:len(draft)] = draft
            if odds is not None:
                odds[i][:len(draft)] = [1.0 if forced else COPY_ODDS] * len(draft)
        out[:, :] = drafts
        if odds is not None:
            confidence[:, :] = odds

    def _matcher(self):
        if self.grammar is None:
            return None
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.grammar)


def advance(requests: list[tuple[Request, list[int]]]) -> None:
    """Each request's matcher through its new tokens. A matcher that refuses a token the target wrote is dropped
    (the request then gets copies only); one that ended takes nothing more. (xgrammar's batch accept was slower:
    its answer is read an element at a time.)"""
    for state, new in requests:
        matcher = state.matcher
        if matcher is None:
            continue
        for token in new:
            if not matcher.accept_token(token):
                if not matcher.is_terminated():
                    state.matcher = None
                break


def read_step(token_ids, total_len, idx, sampled, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(total lengths, tokens sampled, last `width` tokens) of the requests in slots `idx`, from vLLM's tensors of
    every request's tokens ([slots, max_model_len]) and lengths ([slots]), and the step's sampled counts: gathered
    where they are (the GPU) and copied to the host in one copy, which waits for the step's sampling."""
    import torch

    total = total_len[idx].long()
    at = (total[:, None] - width + torch.arange(width, device=total.device)).clamp_(min=0)
    packed = torch.cat([total[:, None], sampled[:len(idx), None].long(), token_ids[idx[:, None], at].long()], 1)
    host = packed.cpu().numpy()
    return host[:, 0], host[:, 1], host[:, 2:]


def read_rows(token_ids, idx, rows: list[int], total_lens: Sequence[int]) -> dict[int, list[int]]:
    """All the tokens of the requests at `rows` of the step (slots `idx[rows]`), in one copy."""
    if not rows:
        return {}
    length = int(max(total_lens[r] for r in rows))
    host = token_ids[idx[rows], :length].cpu().tolist()
    return {r: tokens[:int(total_lens[r])] for r, tokens in zip(rows, host)}
