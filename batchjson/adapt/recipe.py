"""Pass 1's recipe (an adapt.Policy): its change of sampling settings when its first rows show them failing.

Pass 1 decodes with [sampling] (greedy by default) and its failures go to pass 2, which decodes them with
[fallback] (sampled) and without a draft. On a task where greedy decoding fails most rows (it loops, or runs out of
tokens), pass 1 spends its decoding on rows that pass 2 must decode again. `Recipe` judges pass 1's settings on its
first JUDGE_ROWS rows: when fewer than FAILING of them are valid, pass 1 decodes the rest with the fallback's sampling
settings (still with its draft and under the grammar; its failures still go to pass 2), judges those on as many
rows, and goes back to its own settings if they did no better. `sampling.adapt = false` keeps pass 1 on its own.
Each engine (replica) judges its own rows; a resumed run judges again on the rows it decodes.
"""

from __future__ import annotations

import dataclasses

from batchjson.adapt.base import KEEP, Answer, Policy, Resample
from batchjson.records import FINAL, Generation, Outcome, Stage
from batchjson.spec import DecodingSpec, JobSpec

JUDGE_ROWS = 100
FAILING = 0.5


class Recipe(Policy):
    """Pass 1's sampling settings now: its own, or the fallback's once its own fail most of the first rows."""

    def __init__(self, own: DecodingSpec, fallback: DecodingSpec):
        # One candidate per row and pass 1's grammar backend (engine-wide): only the sampling settings change. Another
        # seed than pass 2's: a row that fails here must not get the very same sample again there.
        seed = None if fallback.seed is None else fallback.seed + 1
        theirs = dataclasses.replace(fallback, n=1, structured_output_backend=None, enabled=True, seed=seed)
        self.settings = {"sampling": own, "fallback": theirs}
        self.current = "sampling"
        self.decoded_with = "sampling"  # the settings of the requests in flight now
        self.judged = {"sampling": [0, 0], "fallback": [0, 0]}  # rows, valid
        self.done = False
        self.why = ""

    @classmethod
    def for_job(cls, spec: JobSpec) -> Recipe | None:
        """A judge of pass 1's recipe when the job can use one: a fallback pass that samples otherwise."""
        own, theirs = spec.sampling, spec.fallback
        if not (own.adapt and theirs.enabled) or _sampling(own) == _sampling(theirs):
            return None
        return cls(own, theirs)

    @property
    def decoding(self) -> DecodingSpec:
        return self.settings[self.current]

    def engine_started(self, engine, stage: Stage, seconds: float) -> None:
        self.decoded_with = self.current

    def observe(self, engine, gen: Generation, outcome: Outcome) -> Answer:
        if gen.prompt.stage != Stage.FIRST or not (change := self.add(outcome, self.decoded_with)):
            return KEEP
        # To the fallback's settings the rows in flight go again too (most of them were failing); back to pass
        # 1's own, only the requests from now on.
        return Resample(self.decoding, again=change == "fallback")

    def stream_ended(self, engine) -> None:
        self.decoded_with = self.current

    def add(self, outcome: Outcome, recipe: str) -> str | None:
        """Count a pass-1 row decoded with `recipe`; the recipe to change to now, if any (None: keep this one)."""
        # A failure of the input or of the engine says nothing about the sampling settings.
        if self.done or recipe != self.current or outcome.reason in FINAL or outcome.reason == "engine_error":
            return None
        counts = self.judged[recipe]
        counts[0] += 1
        counts[1] += outcome.ok
        if counts[0] < JUDGE_ROWS:
            return None
        (own_rows, own_valid), (rows, valid) = self.judged.values()
        own = f"{own_valid} of its first {own_rows} rows valid"
        if recipe == "sampling":
            if self._share("sampling") >= FAILING:
                self.done, self.why = True, f"kept its own sampling settings: {own}"
                return None
            self.current = "fallback"
            return "fallback"
        self.done = True
        if self._share("fallback") > self._share("sampling"):
            self.why = (f"the fallback's sampling settings for the rest: its own made {own}, the fallback's "
                        f"{valid} of the next {rows}")
            return None
        self.why = f"back to its own sampling settings: {own}, the fallback's only {valid} of the next {rows}"
        self.current = "sampling"
        return "sampling"

    def _share(self, recipe: str) -> float:
        rows, valid = self.judged[recipe]
        return valid / rows if rows else 0.0

    def report(self, stats) -> None:
        if judged := self.to_dict():
            stats.recipe = [judged]

    def to_dict(self) -> dict:
        """What pass 1 decoded with and why; {} when it had too few rows to judge."""
        if not self.judged["sampling"][0] or (not self.done and self.current == "sampling"):
            return {}
        why = self.why or (f"the fallback's sampling settings for the rest: its own made {self.judged['sampling'][1]} "
                           f"of its first {JUDGE_ROWS} rows valid (the fallback's still being judged)")
        return {"recipe": self.current, "why": why,
                "judged": {k: {"rows": r, "valid": v} for k, (r, v) in self.judged.items() if r}}


def _sampling(d: DecodingSpec) -> tuple:
    """The settings that shape a sample, the seed aside."""
    return (d.temperature, d.top_p, d.max_tokens, d.repetition_penalty, d.frequency_penalty, d.presence_penalty,
            str(d.repetition_detection))
