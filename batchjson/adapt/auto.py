"""`speculative.method = "auto"`: speculation where it pays on this job and this engine, none where it does not.

Speculation costs a bigger step (k+1 positions verified, each under the grammar; drafting; no asynchronous
scheduling) and saves steps in proportion to how many drafted tokens the target accepts. Which side wins depends on
the job's own outputs (acceptance), the in-flight size and the platform. So `auto`:

1. starts with the choice that was faster at this in-flight size, for the measured model nearest in size, in our
   measurements (MEASURED_SPEEDUP; on a GPU: on SmolLM2-135M suffix decoding from 1 to 512 requests in flight, ngram
   only near 32; on the 1.5B suffix only with few in flight (16), no method at 64 or more, a draft model nowhere
   (16 to 1024), batchjson's schema drafts at a full batch x0.79 of none since none's step got CUDA graphs to
   2,048 tokens and its grammar work beside the launch (x0.93-1.13 before);
   none at a full engine batch (the default max_in_flight) and on a CPU; on vLLM 0.34, MEASURED_ON_MRV2: on the
   1.5B suffix decoding with 8 drafts up to 64 in flight, and at a full batch with 2 drafts, about x0.9 of none).
   The other choice is the faster speculative method measured at that size, with the number of drafts measured
   there (draft_tokens): on vLLM 0.34 suffix decoding at a full batch, on older ones the schema drafts, where the
   job has a JSON Schema and the engine can make them;
2. measures that choice on the job's first rows: output tokens per second of decoding, ms per step, tokens per step
   and, with speculation, the acceptance;
3. when the rest of the pass is long enough (TRIAL_PAYS engine starts), decodes the next rows with the other
   choice, measures it the same way, and keeps the faster one (a second start when that is the first one). A
   speculative method measured under WORTH_TRYING of none is not tried (the schema drafts at a full batch on the
   1.5B, x0.79): its trial would cost the pass slower rows and two engine starts for a gain no measured job showed.
   A configured draft model is tried all the same (ours measured one pair of models, the user chose another), and
   no speculation is always tried against a speculative first choice: a job's own acceptance can undo a prior.

A short pass keeps the predicted choice: a trial would cost more than it could save there. A trial that goes back
costs two engine starts, at most 2 / TRIAL_PAYS = 5% of the rest of the pass, so auto stays within 0.95x of the
better choice either way. The report says what was chosen and why.

Auto judges the pass, and the pass is the whole run's cost of speculation: the rows pass 1 fails go to pass 2, which
decodes them without a draft on the same engine (worker.py; engine/vllm/scheduler.py's per-request draft switch). Where
that switch is missing, pass 2 would need an engine of its own after a speculative pass 1, and the worker runs pass
1 without speculation instead of asking auto (BENCHMARKS.md, "One engine start for both passes").
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import time
from dataclasses import dataclass, field

from batchjson.adapt.base import KEEP, Answer, Policy, Switch
from batchjson.engine.base import Engine, EngineFactory
from batchjson.records import Generation, Outcome, Stage
from batchjson.spec import JobSpec, SpeculativeSpec

# Output tokens/s of each speculative method over no speculation, by requests in flight (the nearer of two sizes
# counts): measured on an H200 (bench/spec_profile.py, bench/whole_runs.py); where each figure comes from is in
# BENCHMARKS.md, "auto: the measurements behind its prior". On a CPU verification costs what it saves: no prior gain.
# Keys: platform, then the target's weight gigabytes (the nearest measured size that has the method counts), then
# the method, then requests in flight.
MEASURED_SPEEDUP = {
    "gpu": {0.27: {"ngram": {1: 0.97, 8: 0.64, 32: 1.15, 128: 0.83, 512: 0.86},
                   "suffix": {1: 1.34, 8: 1.65, 32: 2.29, 128: 1.57, 512: 1.38, 1024: 0.88}},
            3.1: {"ngram": {16: 0.90},
                  "suffix": {16: 1.48, 64: 0.85, 1024: 0.57},
                  "draft_model": {16: 0.57, 64: 0.71, 1024: 0.72},
                  "schema": {1024: 0.79}}},
    "cpu": {0.27: {"ngram": {1: 1.0}, "suffix": {1: 1.0}}},
}
# On vLLM 0.34 every drafter runs on Model Runner V2 (suffix decoding is its own, no arctic-inference): the 1.5B's
# figures measured there (H100s, run33 and run34; BENCHMARKS.md, "vLLM 0.34") replace 0.26's; 16 in flight keeps
# 0.26's until measured there. At a full batch each drafted position costs a grammar mask in the scheduler, accepted
# or not: suffix decoding lost with 8 drafts a request (x0.88) and gained x1.14 with 2, against none with vLLM's own
# CUDA graphs (to 512 tokens); batchjson's none captures graphs to 2,048 tokens, which gained x1.16-1.40 on 0.26, so
# against it suffix's 2 drafts are estimated at about x0.9 (x0.82-0.99): under BETTER_BY, so auto starts without
# drafts there, and over WORTH_TRYING, so a long pass measures suffix decoding on its own rows and keeps the faster.
MEASURED_ON_MRV2 = {"gpu": {3.1: {"suffix": {16: 1.48, 64: 1.29, 1024: 0.9}, "ngram": {1024: 0.66},
                                  "schema": {64: 0.81, 1024: 0.61}}}}
MRV2_FROM = (0, 34)  # the first vLLM whose drafters all run on Model Runner V2
DRAFT_TOKENS = {"ngram": 4, "suffix": 8, "schema": 8}  # k as measured above
MRV2_DRAFT_TOKENS = {"suffix": {64: 8, 1024: 2}}  # k by requests in flight (the nearer size) where 0.34 measured it
TRIAL_PAYS = 40.0  # try the other choice only if the rest of the pass takes this many engine starts or more
FULL_BATCH = 1024  # vLLM's largest default batch (max_num_seqs on an H100/H200): an unset max_in_flight fills it
BETTER_BY = 1.05  # a choice must be this much faster to be taken (runs differ by a few % on one engine)
WORTH_TRYING = 0.85  # our speculative methods measured under this x none are not tried after none


def on_model_runner_v2() -> bool:
    """Whether the installed vLLM runs every drafter on Model Runner V2 (0.34 on), read from its package metadata."""
    from batchjson.engine.vllm.versions import installed_version

    version = installed_version()
    try:
        return version is not None and tuple(int(p) for p in version.split(".")[:2]) >= MRV2_FROM
    except ValueError:  # a version we cannot read: as before
        return False


def draft_method() -> str:
    """The speculative method auto tries: suffix decoding where vLLM has its own (0.34) or arctic-inference is
    installed (0.26-0.33), else n-gram lookup."""
    return "suffix" if on_model_runner_v2() or importlib.util.find_spec("arctic_inference") else "ngram"


def predicted_speedup(platform: str, method: str, in_flight: int, weights_gb: float | None = None,
                      mrv2: bool = False) -> float:
    """`method`'s measured output tokens/s over none at the nearest in-flight size, for the measured model nearest
    in size (log scale) to one of `weights_gb` (None: the smallest); 1.0 where nothing was measured. `mrv2`: what
    vLLM 0.34's Model Runner V2 measured replaces the rest, where it measured that model and method."""
    tables = {gb: dict(t) for gb, t in MEASURED_SPEEDUP[platform].items()}
    if mrv2:
        for gb, t in MEASURED_ON_MRV2.get(platform, {}).items():
            tables.setdefault(gb, {}).update(t)
    models = {gb: t[method] for gb, t in tables.items() if method in t}
    if not models:  # unmeasured: no gain assumed; the job measures it
        return 1.0
    gb = min(models, key=lambda g: abs(math.log(g / weights_gb))) if weights_gb else min(models)
    table = models[gb]
    return table[min(table, key=lambda size: abs(size - in_flight))]


def draft_tokens(method: str, in_flight: int, mrv2: bool = False) -> int:
    """The k auto gives `method` at `in_flight` requests: the one measured at the nearest size (MRV2_DRAFT_TOKENS)
    where vLLM 0.34 measured it, else DRAFT_TOKENS'."""
    sizes = MRV2_DRAFT_TOKENS.get(method) if mrv2 else None
    if not sizes:
        return DRAFT_TOKENS[method]
    return sizes[min(sizes, key=lambda size: abs(size - in_flight))]


@dataclass
class Trial:
    """One choice measured on the job's rows: decoding time only (its engine start is counted apart)."""

    method: str
    rows: int = 0
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    drafted: float = 0.0
    accepted: float = 0.0
    start_s: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        d = {"method": self.method, "rows": self.rows, "output_tokens_per_s": round(self.rate, 1),
             "ms_per_step": round(1000 * self.seconds / self.steps, 2) if self.steps else None,
             "tokens_per_step": round(self.tokens / self.steps, 2) if self.steps else None,
             "engine_start_s": round(self.start_s, 1)}
        if self.drafted:
            d["acceptance"] = round(self.accepted / self.drafted, 3)
        return d


@dataclass
class Auto(Policy):
    """The auto policy (an adapt.Policy) for pass 1 on one engine (replica): which speculative config to run now,
    and when to switch. It measures the engines started for pass 1 (its choices), each from its start: every row
    they finish counts (`add`), and once a choice has its sample, `decide` answers."""

    spec: SpeculativeSpec
    in_flight: int | None
    """Requests decoding at once: model.max_in_flight or [model.engine] max_num_seqs, the smaller; None: vLLM's."""
    platform: str
    total_rows: int
    weights_gb: float | None = None
    """The target's weight gigabytes (engine/models.py, weight_bytes): the measurements of the nearest model size count."""
    schema_drafts: bool = False
    """Whether the schema drafter can run on this job and engine (a JSON Schema; engine/vllm/ read this vLLM)."""
    mrv2: bool = False
    """Whether the installed vLLM drafts on Model Runner V2 (0.34): its own measurements count (MEASURED_ON_MRV2)."""
    trials: list[Trial] = field(default_factory=list)
    decided: str = ""
    """Why the current choice is final; empty while measuring."""
    engine: Engine | None = field(default=None, repr=False)
    """The engine of the current choice, measured since `since` (time.monotonic(), its steps then)."""
    since: tuple[float, int] = (0.0, 0)
    ran: bool = False
    """Whether an engine for pass 1 started: a worker that never decoded pass 1 has nothing to report."""

    def __post_init__(self):
        # A configured draft model is the candidate (judged like the others); else the lookup method installed here
        # or, where the engine can make them, the schema drafts, whichever was measured faster at this size.
        size = self.in_flight or FULL_BATCH
        if self.spec.draft_model:
            method = "draft_model"
        else:
            methods = [draft_method()] + (["schema"] if self.schema_drafts else [])
            method = max(methods, key=lambda m: predicted_speedup(self.platform, m, size, self.weights_gb, self.mrv2))
        k = self.spec.num_speculative_tokens if method == "draft_model" else draft_tokens(method, size, self.mrv2)
        self.candidate = dataclasses.replace(self.spec, method=method, num_speculative_tokens=k)
        self.prior = predicted_speedup(self.platform, method, size, self.weights_gb, self.mrv2)
        self.sample = max(2 * size, 64)  # rows measured per choice
        self.trials.append(Trial(method if self.prior >= BETTER_BY else "none"))

    @classmethod
    def for_job(cls, spec: JobSpec, speculative: SpeculativeSpec, engines: EngineFactory, rows: int) -> Auto:
        """The auto policy for pass 1's `speculative` (method "auto") on an engine of `engines`, judging `rows` rows
        (an engine's share of pass 1's): it weighs the target's weight bytes, the platform (a GPU visible here, by
        nvidia-smi), the requests decoding at once (model.max_in_flight, or [model.engine] max_num_seqs where that
        is smaller) and, where the job has a JSON Schema and the engines can make them, the schema drafts."""
        from batchjson.engine import resolve_model, weight_bytes
        from batchjson.engine.devices import visible_gpus

        weights = weight_bytes(resolve_model(spec.model.path))
        in_flight, batch = spec.model.max_in_flight, spec.model.engine.get("max_num_seqs")
        if type(batch) is int and batch > 0:  # a bool is no batch size
            in_flight = min(in_flight or batch, batch)
        drafts = spec.schema_doc is not None and engines.schema_drafts
        return cls(speculative, in_flight, "gpu" if visible_gpus() else "cpu", rows,
                   weights / 1e9 if weights else None, schema_drafts=drafts, mrv2=on_model_runner_v2())

    def config(self, method: str) -> SpeculativeSpec | None:
        return None if method == "none" else self.candidate

    def current(self) -> SpeculativeSpec | None:
        return self.config(self.trials[-1].method)

    def started(self, seconds: float) -> None:
        self.trials[-1].start_s += seconds

    def engine_started(self, engine: Engine, stage: Stage, seconds: float) -> None:
        self.engine = engine if stage == Stage.FIRST else None
        if self.engine is not None:
            self.ran = True
            self.started(seconds)
            self.since = (time.monotonic(), engine.facts().steps)

    def observe(self, engine: Engine, gen: Generation, outcome: Outcome) -> Answer:
        if engine is not self.engine or not self.add(gen.output_tokens):
            return KEEP
        self._measure(engine)
        answer = self.decide()
        if answer is not KEEP:
            self.engine = None  # the next engine's rows are the next choice's
        return answer

    def stream_ended(self, engine: Engine) -> None:
        if engine is self.engine:  # its numbers so far are the choice's measurement
            self._measure(engine)

    def _measure(self, engine: Engine) -> None:
        self.measure(time.monotonic() - self.since[0], engine.facts().steps - self.since[1], engine.stats())

    def refused(self, reason: str) -> Answer:
        self.could_not_start(reason)
        return Switch(None)

    def report(self, stats) -> None:
        if self.ran:
            stats.auto = [self.to_dict()]

    def add(self, tokens: int) -> bool:
        """One more finished row of the current choice; True when it is time to measure and decide."""
        trial = self.trials[-1]
        trial.rows += 1
        trial.tokens += tokens
        return not self.decided and trial.rows >= self.sample

    def measure(self, seconds: float, steps: int, stats: dict | None) -> None:
        """The current choice's decoding seconds and engine steps so far, and its speculative counters."""
        trial = self.trials[-1]
        trial.seconds, trial.steps = seconds, steps
        if stats:  # each choice runs on its own engine, whose counters start at zero
            trial.drafted, trial.accepted = stats.get("draft_tokens", 0.0), stats.get("accepted_tokens", 0.0)

    def decide(self) -> Answer:
        """Switch to the other choice (a trial, or back), or KEEP this one."""
        trial = self.trials[-1]
        if self.decided or trial.rows < self.sample:
            return KEEP
        done = sum(t.rows for t in self.trials)
        if len(self.trials) == 1:
            rest_s = (self.total_rows - done) * trial.seconds / trial.rows
            start_s = max(trial.start_s, 1.0)
            if rest_s < TRIAL_PAYS * start_s:
                self.decided = (f"kept {trial.method}: the rest of the pass (~{rest_s:.0f} s) is too short to pay for "
                                f"trying the other choice ({start_s:.0f} s per engine start)")
                return KEEP
            if trial.method == "none" and self.prior < WORTH_TRYING and not self.spec.draft_model:
                self.decided = (f"kept none: {self.candidate.method} was measured at {self.prior:.2f}x none at this "
                                "size, too slow to be worth a trial")
                return KEEP
            other = "none" if trial.method != "none" else self.candidate.method
            self.trials.append(Trial(other))
            return Switch(self.config(other))
        first, second = self.trials
        if second.rate > BETTER_BY * first.rate:
            self.decided = f"{second.method}: {second.rate / first.rate:.2f}x the output tokens/s of {first.method}"
            return KEEP
        self.decided = f"{first.method}: {second.method} made {second.rate / first.rate:.2f}x its output tokens/s"
        self.trials.append(dataclasses.replace(first, rows=0, tokens=0, seconds=0.0, steps=0))
        return Switch(self.config(first.method))

    def could_not_start(self, reason: str) -> None:
        """The engine for the current (speculative) choice did not start: decode without speculation from here on."""
        failed = self.trials[-1]
        self.decided = f"none: {failed.method} could not start here ({reason[:300]})"
        if not failed.rows:
            self.trials.pop()
        self.trials.append(Trial("none"))

    def to_dict(self) -> dict:
        chosen = self.trials[-1].method
        size = f"{self.in_flight} in flight" if self.in_flight else "a full engine batch"
        model = f" with a {self.weights_gb:.1f} GB model" if self.weights_gb else ""
        why = self.decided or (f"{chosen}: the faster at {size} on a {self.platform}{model} in our "
                               f"measurements ({self.candidate.method} {self.prior:.2f}x none); the pass was too short "
                               "to try the other")
        return {"method": "auto", "chosen": chosen, "why": why,
                "predicted_speedup": round(self.prior, 2), "in_flight": self.in_flight, "platform": self.platform,
                "weights_gb": round(self.weights_gb, 2) if self.weights_gb else None,
                "trials": [t.to_dict() for t in self.trials if t.rows]}
