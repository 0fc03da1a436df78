"""FakeEngine (and FakeEngines, its factory): an engine without a model, under the Engine contract as VllmEngine.

For tests and benchmarks of everything around decoding: routing, commits, resume, kills, replicas and the runner's
own cost per row.

Pass `engine_factory=FakeEngines(...)` to run_job. Each prompt gets a valid answer (a share `valid` of them) or
a failure, by a random roll (seeded or not: a unit redone after a kill usually comes out differently, as it does
with sampling), or in a fixed cycle over every 100 prompts (`cycle=True`: the same counts every run).
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from batchjson.engine.base import Engine, EngineFactory, EngineFacts
from batchjson.errors import EngineDied
from batchjson.records import WAIT, Generation, Prompt, Stage
from batchjson.spec import DecodingSpec, SpeculativeSpec


@dataclass(frozen=True)
class Answer:
    """What the fake engine answers: the text, how it finished, and the output tokens it counts."""

    text: str
    finish_reason: str = "stop"
    output_tokens: int = 8


# For the tests' schema ({"name": string, "n": integer}): one valid answer, broken JSON, and a cut at max_tokens.
VALID = json.dumps({"name": "ab", "n": 3}, separators=(",", ":"))
ANSWERS = (Answer(VALID, "stop", 8),)
FAILURES = (Answer('{"name":', "stop", 3), Answer('{"name":"abababab', "length", 48))


class FakeEngine(Engine):
    """Answers each prompt at once (after `delay` seconds) with one of `answers` or `failures`.

    `max_in_flight` prompts are held before the first answer, as the real engine keeps them in flight (1: answer
    each prompt as it arrives). After `die_after` prompts the engine dies (EngineDied with the prompts in flight).
    `speculative`: the engine runs with speculation (it accepts only passes that ask for it, and, with `no_draft`,
    passes without it, whose prompts it then answers without a draft: `drafted` counts prompts per stage that got
    drafts). `sampled_valid`: the valid share of prompts whose pass samples (temperature > 0), where greedy
    decoding gets `valid` (a task where greedy decoding loops).
    """

    def __init__(self, valid: float = 0.6, *, seed: int | None = None, delay: float = 0.0,
                 die_after: int | None = None, speculative: bool = False, max_in_flight: int = 1,
                 cycle: bool = False, answers: Sequence[Answer] = ANSWERS, failures: Sequence[Answer] = FAILURES,
                 prompt_tokens: int = 10, no_draft: bool = True, sampled_valid: float | None = None):
        self.rng = random.Random(seed)
        self.sampled_valid = sampled_valid
        self.valid, self.delay, self.die_after, self.speculative = valid, delay, die_after, speculative
        self.max_in_flight, self.cycle, self.prompt_tokens = max(1, max_in_flight), cycle, prompt_tokens
        self.answers, self.failures = tuple(answers), tuple(failures)
        self.unfinished: list[Prompt] = []
        self.no_draft = no_draft
        self.decoding: dict[str, DecodingSpec] = {}
        self.draft: dict[str, bool] = {}
        self.drafted: Counter = Counter()  # stage -> prompts answered with drafts
        self.stages: Counter = Counter()  # stage -> prompts answered
        self.answered = 0
        self.steps, self.step_s = 0, 0.0
        self.told = EngineFacts()  # the rest of its facts (`facts`): tests set a notice or an audit's rows here
        self.closed = False

    def accepts(self, decoding: DecodingSpec, speculative: SpeculativeSpec | None) -> bool:
        return (speculative is not None) == self.speculative or (speculative is None and self.no_draft)

    def use(self, decoding: DecodingSpec, stage: Stage = Stage.FIRST, draft: bool = True) -> None:
        self.decoding[stage], self.draft[stage] = decoding, draft and self.speculative

    def stream(self, prompts: Iterable[Prompt], stop: threading.Event | None = None) -> Iterator[Generation]:
        stop = stop or threading.Event()
        window: deque[Prompt] = deque()
        self.unfinished, taken = [], 0
        for prompt in prompts:
            if stop.is_set():
                # What was taken from the feed but not answered: another engine takes it over.
                self.unfinished = list(window) + ([prompt] if prompt is not WAIT else [])
                return
            if prompt is WAIT:
                if window:  # nothing new to add: the engine steps on what it holds
                    yield self.answer(window.popleft())
                else:
                    time.sleep(0.005)
                continue
            taken += 1
            window.append(prompt)
            if self.die_after is not None and taken > self.die_after:
                raise EngineDied(list(window))
            if len(window) >= self.max_in_flight:
                yield self.answer(window.popleft())
        while window:
            if stop.is_set():
                self.unfinished = list(window)
                return
            yield self.answer(window.popleft())

    def answer(self, prompt: Prompt) -> Generation:
        """The answer to one prompt (one engine step): valid, or one of the failures."""
        began = time.monotonic()
        if self.delay:
            time.sleep(self.delay)
        self.steps += 1
        self.step_s += time.monotonic() - began
        self.answered += 1
        n = self.answered
        self.stages[prompt.stage] += 1
        if self.draft.get(prompt.stage):
            self.drafted[prompt.stage] += 1
        decoding = self.decoding.get(prompt.stage)
        sampled = self.sampled_valid is not None and decoding is not None and decoding.temperature > 0
        valid = self.sampled_valid if sampled else self.valid
        if self.cycle:
            slot = n % 100
            failed = slot < round((1 - valid) * 100)
            pick = self.failures[slot % len(self.failures)] if failed else None
        else:
            roll = self.rng.random()
            failed = roll >= valid
            pick = self.failures[min(int((roll - valid) / (1 - valid) * len(self.failures)),
                                     len(self.failures) - 1)] if failed else None
        a = pick or self.answers[n % len(self.answers)]
        return Generation(prompt, a.text, a.finish_reason, self.prompt_tokens, a.output_tokens)

    def facts(self) -> EngineFacts:
        """Its steps, and what a test has it tell (`told`: a notice, an audit's rows)."""
        return dataclasses.replace(self.told, steps=self.steps, step_s=self.step_s)

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self.closed = True


class FakeEngines(EngineFactory):
    """An engine factory for run_job: a new FakeEngine (with `kwargs`) per engine start, recorded in `started`.

    `start_delay`: seconds an engine start takes (signals arrive meanwhile); `start_marker`: a file created when a
    start begins, so a test can signal the runner inside it. `spec_delay`: the delay of a speculative engine
    (faster or slower than without). `schema_drafts`: whether its engines say they can run the schema drafter;
    `measures`: whether their starts say they measure the GPU's memory (as a vLLM engine's first start of its
    settings)."""

    def __init__(self, start_delay: float = 0.0, start_marker: str | None = None, spec_delay: float | None = None,
                 schema_drafts: bool = False, measures: bool = True, **kwargs):
        self.start_delay, self.start_marker, self.spec_delay = start_delay, start_marker, spec_delay
        self._schema_drafts, self._measures = schema_drafts, measures
        self.kwargs = kwargs
        self.started: list[tuple[DecodingSpec, SpeculativeSpec | None]] = []
        self.engines: list[FakeEngine] = []  # in this process (a replica's are in its own)

    @property
    def drafts_optional(self) -> bool:
        return self.kwargs.get("no_draft", True)

    @property
    def schema_drafts(self) -> bool:
        return self._schema_drafts

    def measures(self, spec, decoding: DecodingSpec, speculative: SpeculativeSpec | None) -> bool:
        return self._measures

    def start(self, spec, decoding: DecodingSpec, speculative: SpeculativeSpec | None) -> FakeEngine:
        if self.start_marker:
            open(self.start_marker, "w").close()
        time.sleep(self.start_delay)
        kwargs = dict(self.kwargs)
        if speculative is not None and self.spec_delay is not None:
            kwargs["delay"] = self.spec_delay
        self.started.append((decoding, speculative))
        self.engines.append(FakeEngine(speculative=speculative is not None, **kwargs))
        return self.engines[-1]
