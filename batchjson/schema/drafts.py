"""Drafts that the schema and the input already hold: the tokens a request's grammar forces next, and copies from its
prompt. The proposal half of the schema drafter (issue "the schema drafts"); which engine asks for them, and how its
verification is kept cheap, is the engine's part.

Why these two. In an extraction job a third to a half of the output tokens are forced by the JSON Schema (keys,
quotes, colons, commas, closing braces: xgrammar's `find_jump_forward_string`), and many of the rest copy the input
(names, emails, amounts). A model draft or an n-gram lookup guesses both at a cost; the grammar knows the first
for certain, and the prompt holds the second. The bitmask alone forces a single token only where one token is
allowed, which is rare (a forced `"name": "` can be written in several tokenizations): so what is proposed is the
canonical tokenization of the forced string, which is what a model trained on such text writes.

`Drafter.propose` looks at one request: its grammar's matcher (advanced through the output so far: the engine's own,
in the scheduler), the prompt's token ids and the output's. It proposes nothing where nothing is known, so a request inside a free-text value that
copies nothing costs its verification nothing. Pure xgrammar and a tokenizer's `encode`: no engine, no vLLM.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

COPY_MIN, COPY_MAX = 3, 4  # the output's last 3-4 tokens found in the prompt start a copy (vLLM's ngram: 2-4)


class Drafter:
    """Up to `k` draft tokens per request from what its grammar forces and what its prompt holds.

    `encode(text)` is the tokenizer's encoding without special tokens. `forced`: propose the forced continuation's
    tokens; `copies`: where nothing is forced (inside a value), a copy from the prompt. `trim`: drop the forced
    string's last token where what follows may join it (after `"name": "` the value's first characters may join the
    quote in one token). The defaults are the best of `python -m bench drafts` (BENCHMARKS.md, "The schema drafts,
    offline"): untrimmed forced strings were accepted whole on two tasks of three and gave more tokens per step on
    all three; copies found by 3 tokens, from the prompt alone and only where nothing is forced, were accepted
    68-86% of the time, against 46-59% for 2-token copies searched in the output too and appended to forced strings.
    """

    def __init__(self, encode: Callable[[str], list[int]], k: int = 8, *, forced: bool = True, copies: bool = True,
                 trim: bool = False):
        self.encode, self.k, self.forced, self.copies, self.trim = encode, k, forced, copies, trim
        self._cache: dict[str, list[int]] = {}  # forced string -> its tokens (a schema has few of them)

    def propose(self, matcher, prompt: PromptIndex | Sequence[int], output: Sequence[int]) -> list[int]:
        """The draft for one request: the forced continuation's tokens, or else a copy from the prompt (its
        PromptIndex, made once per request, or its tokens) of what followed the output's last tokens there; at most
        `k`; [] when neither is known. Only the output's last COPY_MAX tokens are read."""
        return self.draft(matcher, prompt, output)[0]

    def draft(self, matcher, prompt: PromptIndex | Sequence[int], output: Sequence[int]) -> tuple[list[int], str]:
        """propose's draft, with the forced string its tokens spell ("" for a copy or no draft)."""
        if self.forced:
            text = matcher.find_jump_forward_string()
            if text:
                return self._tokens(text)[:self.k], text
        if not self.copies:
            return [], ""
        return (prompt if isinstance(prompt, PromptIndex) else PromptIndex(prompt)).after(output, self.k), ""

    def _tokens(self, text: str) -> list[int]:
        tokens = self._cache.get(text)
        if tokens is None:
            tokens = self.encode(text)
            if self.trim and len(tokens) > 1 and text[-1] in '"[{:, ':  # what follows may join the last token
                tokens = tokens[:-1]
            self._cache[text] = tokens
        return tokens


class PromptIndex:
    """A prompt's tokens as 32-bit words in one bytes object, searched from the end for the output's tail: made
    once per request at the cost of one copy (the engine's scheduler meets tens of new requests a step), where an
    index of every run of 3-4 tokens cost 120-290 us a prompt on a CPU core; a search is a few microseconds."""

    def __init__(self, prompt: Sequence[int], shortest: int = COPY_MIN):
        self.prompt, self.shortest = list(prompt), shortest
        self.words = array("i", self.prompt).tobytes()

    def after(self, output: Sequence[int], n: int) -> list[int]:
        """Up to `n` tokens that followed, in the prompt, the longest tail of `output` (COPY_MAX down to `shortest`
        tokens) found there, at its last occurrence with a token after it; [] if no such tail occurs."""
        if n <= 0:
            return []
        end = 4 * (len(self.prompt) - 1)  # a run must end before the prompt's last token
        for size in range(min(COPY_MAX, len(output)), self.shortest - 1, -1):
            tail = array("i", output[len(output) - size:]).tobytes()
            at = self.words.rfind(tail, 0, end)
            while at > 0 and at % 4:  # found across two words: look further back
                at = self.words.rfind(tail, 0, at + len(tail) - 1)
            if at >= 0:  # a word's start (the loop ends on one, or on -1)
                start = at // 4 + size
                return self.prompt[start:start + n]
        return []


def copy_after(output: Sequence[int], prompt: Sequence[int], n: int, shortest: int = COPY_MIN) -> list[int]:
    """PromptIndex(prompt, shortest).after(output, n), for one lookup. vLLM's n-gram lookup is this with `shortest`
    2 over the prompt and the output together."""
    return PromptIndex(prompt, shortest).after(output, n)
