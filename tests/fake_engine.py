"""A fake engine (the Engine protocol, no model) for fast tests of routing, commits, resume and kills.

Each prompt gets a random outcome, unless the engine is seeded: valid JSON for the tests' schema, broken JSON,
or a cut at max_tokens. So a unit redone after a kill usually comes out differently, as it does with sampling.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time

from batchjson.records import WAIT, Generation

VALID = json.dumps({"name": "ab", "n": 3}, separators=(",", ":"))


class FakeEngine:
    def __init__(self, valid: float = 0.6, seed: int | None = None, delay: float = 0.0, die_after: int | None = None):
        self.rng = random.Random(seed)
        self.valid, self.delay, self.die_after = valid, delay, die_after
        self.closed = False
        self.speculative = False

    def accepts(self, decoding, speculative):
        return speculative is None and not self.speculative

    def use(self, decoding):
        self.decoding = decoding

    def stream(self, prompts, stop: threading.Event | None = None):
        stop = stop or threading.Event()
        i, self.unfinished = 0, []
        for prompt in prompts:
            if stop.is_set():
                self.unfinished = [prompt] if prompt is not WAIT else []  # taken from the feed, not decoded
                return
            if prompt is WAIT:
                time.sleep(0.005)
                continue
            i += 1
            if self.die_after is not None and i > self.die_after:
                from batchjson.errors import EngineDied

                raise EngineDied([prompt])
            time.sleep(self.delay)
            roll = self.rng.random()
            if roll < self.valid:
                yield Generation(prompt, VALID, "stop", 10, 8)
            elif roll < (1 + self.valid) / 2:
                yield Generation(prompt, '{"name":', "stop", 10, 3)
            else:
                yield Generation(prompt, '{"name":"abababab', "length", 10, 48)

    def stats(self):
        return {}

    def close(self):
        self.closed = True


class FakeEngines:
    """An engine factory: a new FakeEngine per start, counting the starts."""

    def __init__(self, start_delay: float = 0.0, start_marker: str | None = None, **kwargs):
        self.kwargs, self.started, self.start_delay, self.start_marker = kwargs, [], start_delay, start_marker

    def __call__(self, spec, decoding, speculative):
        if self.start_marker:  # lets a test signal the runner once it is inside the engine start
            open(self.start_marker, "w").close()
        time.sleep(self.start_delay)  # an engine start takes a while; signals arrive meanwhile
        kwargs = dict(self.kwargs)
        if speculative is not None and "spec_delay" in kwargs:  # speculation faster or slower than none
            kwargs["delay"] = kwargs["spec_delay"]
        kwargs.pop("spec_delay", None)
        if os.environ.get("BATCHJSON_REPLICA", "-") == os.environ.get("FAKE_SLOW_SLOT"):  # one slow replica
            kwargs["delay"] = kwargs.get("delay", 0) * 50
        engine = FakeEngine(**kwargs)
        engine.speculative = speculative is not None
        self.started.append((decoding, speculative))
        return engine
