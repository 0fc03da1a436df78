"""The schema drafter's proposals (schema/drafts.py): the tokens the grammar forces next, a copy from the prompt where
nothing is forced, nothing where nothing is known; each checked against what a decoder of the answer would accept."""

from __future__ import annotations

import json
import random

import pytest

from batchjson.schema.drafts import COPY_MAX, Drafter, copy_after

xgr = pytest.importorskip("xgrammar")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "plan": {"enum": ["free", "pro"]}},
          "required": ["name", "plan"], "additionalProperties": False}
PROMPT = "Add Omar Khan to the free plan."


@pytest.fixture(scope="module")
def kit(tiny_model):
    """(the tiny model's tokenizer, SCHEMA compiled as vLLM compiles it: no whitespace)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer)).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False)
    return tokenizer, compiled


def encoder(tokenizer):
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def test_the_forced_continuation_is_proposed_as_the_tokenizer_writes_it(kit):
    tokenizer, compiled = kit
    matcher = xgr.GrammarMatcher(compiled)
    forced = matcher.find_jump_forward_string()
    assert forced.startswith('{"name"')  # the grammar's own separators, whatever they are
    draft = Drafter(encoder(tokenizer), k=64).propose(matcher, [], [])
    assert draft == tokenizer.encode(forced, add_special_tokens=False)
    assert all(matcher.accept_token(t) for t in draft)  # every proposed token is one the grammar takes
    assert Drafter(encoder(tokenizer), k=2).propose(xgr.GrammarMatcher(compiled), [], []) == draft[:2]


def test_inside_a_value_the_drafter_copies_what_followed_in_the_prompt(kit):
    tokenizer, compiled = kit
    encode = encoder(tokenizer)
    matcher = xgr.GrammarMatcher(compiled)
    drafter = Drafter(encode, k=64)
    head = drafter.propose(matcher, [], [])
    assert all(matcher.accept_token(t) for t in head)
    prompt = encode(PROMPT)
    name = encode(" Omar Khan")  # as the prompt spells it, so the copy lines up with the prompt's tokens
    start = next(i for i in range(len(prompt)) if prompt[i:i + len(name)] == name)
    typed = prompt[start:start + 3]  # the value's first three tokens, as the prompt has them
    assert all(matcher.accept_token(t) for t in typed)
    assert matcher.find_jump_forward_string() == ""  # inside a free-text value nothing is forced
    assert drafter.propose(matcher, prompt, [*head, *typed]) == prompt[start + 3:]


def test_nothing_known_proposes_nothing(kit):
    tokenizer, compiled = kit
    encode = encoder(tokenizer)
    matcher = xgr.GrammarMatcher(compiled)
    head = Drafter(encode).propose(matcher, [], [])
    assert all(matcher.accept_token(t) for t in head)
    typed = encode("Zq")
    assert all(matcher.accept_token(t) for t in typed)
    assert Drafter(encode).propose(matcher, encode(PROMPT), [*head, *typed]) == []
    assert Drafter(encode, copies=False).propose(matcher, encode(PROMPT), [*head, *typed]) == []
    assert Drafter(encode, forced=False).propose(xgr.GrammarMatcher(compiled), encode(PROMPT), []) == []


def test_copy_after_takes_the_longest_tail_at_its_last_occurrence():
    prompt = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3, 4, 6]
    assert copy_after([0, 1, 2, 3], prompt, 2) == [4, 5]  # tail 1 2 3 (last occurrence), not 2 3 -> 4 6
    assert copy_after([0, 2, 3, 4], prompt, 5) == [6]  # tail 2 3 4 at its last occurrence, to the prompt's end
    assert copy_after([8, 8, 8, 8], prompt, 3) == []
    assert copy_after([2, 3], prompt, 3) == []  # shorter than the shortest tail looked for
    assert copy_after([2, 3], prompt, 3, shortest=2) == [4, 6]
    assert copy_after([1, 2, 3], prompt, 0) == []
    assert copy_after([3, 4, 6], prompt, 2) == []  # found only where nothing follows
    # Token ids whose bytes line up across two ids elsewhere: 256 0 0 is not in the prompt, though its bytes are
    assert copy_after([256, 0, 0], [0, 1, 0, 0, 5], 2) == []
    assert copy_after([0, 1, 0], [0, 1, 0, 0, 5], 2) == [0, 5]
    assert copy_after([0, 0, 0], [0, 0, 0, 256, 65536, 256, 1], 3) == [256, 65536, 256]  # the last is misaligned


def test_copy_after_is_the_last_occurrence_of_the_longest_tail_on_any_tokens():
    """Against its definition, written out, on random prompts over small and large vocabularies."""
    def by_definition(output, prompt, n, shortest):
        for size in range(min(COPY_MAX, len(output)), shortest - 1, -1):
            tail = list(output[len(output) - size:])
            found = [at for at in range(len(prompt) - size) if prompt[at:at + size] == tail]
            if found:
                return prompt[found[-1] + size:found[-1] + size + n]
        return []

    rng = random.Random(7)
    for _ in range(3000):
        ids = rng.choice([range(3), range(151_936), range(2**31 - 1), (0, 1, 256, 65536)])  # the last: bytes that align
        prompt = [rng.choice(ids) for _ in range(rng.randrange(12))]
        output = [rng.choice(ids) for _ in range(rng.randrange(4))]
        if prompt and rng.random() < 0.5:
            at = rng.randrange(len(prompt))
            output += prompt[max(0, at - rng.randrange(1, 5)):at]
        n, shortest = rng.randrange(9), rng.choice([2, 3])
        assert copy_after(output, prompt, n, shortest) == by_definition(output, prompt, n, shortest), (output, prompt)
