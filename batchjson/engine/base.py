"""The Engine contract: what a pass needs from an engine (the ABC), what it tells the run about itself (one
EngineFacts value), the factory that starts a run's engines, and a wrapper that watches or breaks one."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from batchjson.records import Generation, Prompt, Stage
from batchjson.spec import DecodingSpec, JobSpec, SpeculativeSpec


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What an engine tells the run about itself, as of now (`Engine.facts`): the report's lines on the engine, and
    the counters the worker and the adaptive policies (adapt/) measure it by. The defaults suit an engine without
    such facts."""

    steps: int = 0
    """Engine steps taken so far (auto's ms per step, and the report's)."""
    step_s: float = 0.0
    """The seconds spent in them."""
    grammar: str = ""
    """The grammar backend it decodes with, why, and how it fills the grammar's masks (the report's grammar line);
    "" without a grammar."""
    notice: str = ""
    """What the run's report should say about the engine itself (VllmEngine: its vLLM is one batchjson's patches
    were not read on, see engine/vllm/versions.py, notice); "" for nothing."""
    notice_code: str = ""
    """The notice's code (a report.NoteCode); "" for the generic "engine-notice"."""
    kv_kept: int | None = None
    """The bytes of KV cache it was given from an earlier start's measurement (kv_sizes.py); None where it
    measured, or has no such cache."""
    audited: int = 0
    """The speculation audit's rows so far ([speculative] audit_rows) ..."""
    differ: int = 0
    """... and how many of them decoded otherwise without drafts."""


class Engine(ABC):
    """What a pass needs from an engine: bounded in flight, results yielded as they finish.

    VllmEngine is the real one; batchjson.engine.fake.FakeEngine answers without a model, for tests and benchmarks.
    A subclass that misses a method cannot be constructed. What the run reports of an engine it asks in one value,
    `facts()`. Besides the methods, worker.py reads two attributes, which each engine keeps up to date (the defaults
    here suit an engine without them): `unfinished`, the prompts that were in flight when the last stream stopped
    (another engine takes them over), and `tokenizer`, the model's tokenizer where the engine loaded one (the worker
    renders prompts with it instead of loading it again; None: the worker loads it from the model's files).
    """

    unfinished: Sequence[Prompt] = ()
    tokenizer: object | None = None

    @abstractmethod
    def accepts(self, decoding: DecodingSpec, speculative: SpeculativeSpec | None) -> bool:
        """Whether a pass with these settings can run on this engine without a restart. `speculative` None on a
        speculative engine: whether its requests can be decoded without a draft (see `use`)."""

    @abstractmethod
    def use(self, decoding: DecodingSpec, stage: Stage = Stage.FIRST, draft: bool = True) -> None:
        """Decode prompts of `stage` (Prompt.stage) with these sampling settings from now on, and on a speculative
        engine with drafts or without (`draft`), so that both passes share one engine."""

    @abstractmethod
    def stream(self, prompts: Iterable[Prompt], stop: threading.Event | None = None) -> Iterator[Generation]:
        """Yield a Generation per prompt as each finishes (WAIT in `prompts`: none is ready yet). A stop ends the
        stream at the next step; the prompts still in flight are then in `unfinished`. EngineDied carries the
        prompts in flight when the engine died."""

    @abstractmethod
    def facts(self) -> EngineFacts:
        """What the engine tells the run about itself now: its steps so far, its grammar line, its notice."""

    @abstractmethod
    def stats(self) -> dict[str, float]:
        """Speculative decoding counters (drafts, draft_tokens, accepted_tokens); empty or zero without."""

    @abstractmethod
    def close(self) -> None:
        """Free the engine; a closed engine is not used again."""


class EngineFactory(ABC):
    """Starts a run's engines, and says before any starts whether a speculative one can decode a request without a
    draft (which passes an engine then decodes is passes.py's question: `decoded_by`).

    VllmEngines (vllm_engine.py) starts VllmEngine, FakeEngines (fake.py) the fake. A factory goes to each replica
    (pickled), so it holds settings, not engines. Tests and benchmarks that watch or break engines wrap a factory's
    engines (WrappedEngines) or subclass it.
    """

    @abstractmethod
    def start(self, spec: JobSpec, decoding: DecodingSpec, speculative: SpeculativeSpec | None) -> Engine:
        """A new engine for a pass with these settings (the engine-wide ones: grammar backend, draft, and on a CPU
        the seed, which passes.engine_decoding has set); EngineError when it cannot start."""

    @property
    @abstractmethod
    def drafts_optional(self) -> bool:
        """Whether its speculative engines can decode a request without a draft. When they can, pass 2 decodes
        beside pass 1 on a speculative engine; when not, pass 2 would need an engine start of its own."""

    @property
    def schema_drafts(self) -> bool:
        """Whether its engines can run `[speculative] method = "schema"` (auto then considers it)."""
        return False

    def measures(self, spec: JobSpec, decoding: DecodingSpec, speculative: SpeculativeSpec | None) -> bool:
        """Whether an engine with these settings measures its GPU's memory as it starts (then no other engine on
        that GPU may start or close meanwhile: executors/base.py, Turns)."""
        return True


class EngineWrapper(Engine):
    """An engine around another one, for tests and benchmarks that watch or break it (a subclass overrides what
    it changes, usually stream); everything else is the inner engine's."""

    def __init__(self, inner: Engine):
        self.inner = inner

    unfinished = property(lambda self: self.inner.unfinished)
    tokenizer = property(lambda self: self.inner.tokenizer)

    def accepts(self, decoding: DecodingSpec, speculative: SpeculativeSpec | None) -> bool:
        return self.inner.accepts(decoding, speculative)

    def use(self, decoding: DecodingSpec, stage: Stage = Stage.FIRST, draft: bool = True) -> None:
        self.inner.use(decoding, stage, draft)

    def stream(self, prompts: Iterable[Prompt], stop: threading.Event | None = None) -> Iterator[Generation]:
        return self.inner.stream(prompts, stop)

    def facts(self) -> EngineFacts:
        return self.inner.facts()

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # the inner engine's own attributes (VllmEngine.params, .llm)
        if name == "inner":  # not set yet (unpickling): not the inner engine's either
            raise AttributeError(name)
        return getattr(self.inner, name)



class WrappedEngines(EngineFactory):
    """A factory around another one, for tests and benchmarks that watch or break its engines: each engine it
    starts goes through `wrap` (usually into an EngineWrapper); everything else is the inner factory's."""

    def __init__(self, inner: EngineFactory, wrap: Callable[[Engine], Engine]):
        self.inner, self.wrap = inner, wrap

    def start(self, spec: JobSpec, decoding: DecodingSpec, speculative: SpeculativeSpec | None) -> Engine:
        return self.wrap(self.inner.start(spec, decoding, speculative))

    @property
    def drafts_optional(self) -> bool:
        return self.inner.drafts_optional

    @property
    def schema_drafts(self) -> bool:
        return self.inner.schema_drafts
