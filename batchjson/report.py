"""The run report: counts per pass and reason (read back from the committed files), tokens, speed, spec hash."""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Literal

from batchjson.records import Stage

RESCUED = Stage.SECOND.label  # valid_by_pass's key of the rows the fallback pass rescued

# What a note says happened, as a stable code next to its text in the report's "events" (the text is for people and
# may be reworded; a program or a test reads the code).
NoteCode = Literal[
    "replica-died",  # a replica (process or actor) died; its open units were handed to others
    "engine-restarted",  # the engine died and was restarted (its rows in flight were redone)
    "engine-hung",  # the engine made no step for model.hang_timeout_s: killed and restarted
    "speculation-off",  # speculation switched off after repeated engine deaths
    "auto-no-speculation",  # auto chose no speculation: pass 2 could not share a speculative engine in this vLLM
    "shared-engine",  # the pass decoded on the previous pass's engine, with no engine start of its own
    "unit-redone",  # a damaged unit was dropped and redone
    "unread-vllm",  # the engine's vLLM is not a version batchjson's patches were read on: they are off
    "patches-off",  # batchjson's engine patches are off in this vLLM (a check failed)
    "engine-notice",  # anything else an engine says about itself
    "kv-size-kept",  # the engine's KV cache took the size vLLM measured at an earlier start of its settings
    "cancelled",  # `batchjson cancel` stopped the run (the same clean stop as SIGTERM)
]


def record(events: list[dict], code: NoteCode, text: str) -> None:
    """Add a note's code and text to `events`, once."""
    if {"code": code, "text": text} not in events:
        events.append({"code": code, "text": text})


def process_age(at: float) -> float | None:
    """Seconds from this process's start to `at` (a time.monotonic()); None where /proc does not say (not Linux)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: clock ticks after boot
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME) - (time.monotonic() - at)
        return round(since_boot - ticks / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


@dataclass
class PassStats:
    """What one pass did in this invocation (a resumed run counts only its own work here)."""

    rows: int = 0
    valid: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    failed_output_tokens: int = 0
    """Output tokens of rows that failed this pass: decoding paid for nothing (loops cut late, truncation)."""
    seconds: float = 0.0
    reasons: Counter = field(default_factory=Counter)
    speculative: dict = field(default_factory=dict)
    note: str = ""
    """What happened to the pass, in words ("; " between notes); each event's code is in `events`."""
    events: list = field(default_factory=list)
    """One {"code": NoteCode, "text": ...} per note the pass was given (`note`, and `notice`), in order: the code
    is stable, the text as it was given (`note` keeps the first of some)."""
    grammar: str = ""
    """The grammar backend this pass decoded with, and why it was chosen."""
    notice: str = ""
    """What this pass's engine said about itself (its patches off on this vLLM: engine/vllm/versions.py); the
    summary says it once."""
    replicas: int = 1
    """Engine replicas the pass ran on at once: its engine-seconds are seconds x replicas."""
    auto: list = field(default_factory=list)
    """speculative.method = "auto": what each engine (replica) chose and why (see adapt/auto.py)."""
    recipe: list = field(default_factory=list)
    """Pass 1 only: per engine (replica) that judged its first rows, the sampling settings it decoded the rest with
    and why (see adapt/recipe.py)."""
    engine_starts: int = 0
    """Engines this pass started (all replicas): 0 when it ran on the previous pass's engine."""
    engine_start_s: float = 0.0
    """Their start seconds, added up."""
    engine_close_s: float = 0.0
    """Shutdown seconds of the engines that decoded this pass last (an engine shared by both passes counts in the
    later pass that had rows)."""
    engine_steps: int = 0
    """Engine steps taken while the engines decoded this pass (all replicas; where pass 2 decodes on pass 1's engine,
    beside pass 1's rows, those steps count in pass 1). The summary's engine line gives the run's steps."""
    engine_step_s: float = 0.0
    """Their seconds, added up: ms per step is what a step of this pass's batch cost (the grammar's fills included)."""
    hung: int = 0
    """Engines taken for hung (no step for model.hang_timeout_s), killed and restarted."""
    first_request_s: float | None = None
    """Seconds from the run's start to this pass's first request to an engine (the earliest replica's; a replica in
    a process of its own counts from its worker's start)."""

    def event(self, code: NoteCode, text: str) -> str:
        """Record an event of this pass (its code and text in `events`); returns the text, for `note`."""
        record(self.events, code, text)
        return text

    def first_note(self, code: NoteCode, text: str) -> None:
        """Record an event; `note` keeps the first one it was given."""
        self.event(code, text)
        self.note = self.note or text

    def add(self, ok: bool, reason: str | None, prompt_tokens: int, output_tokens: int) -> None:
        self.rows += 1
        self.valid += ok
        self.prompt_tokens += prompt_tokens
        self.output_tokens += output_tokens
        if not ok:
            self.failed_output_tokens += output_tokens
        if reason:
            self.reasons[reason] += 1

    def merge(self, other: dict) -> None:
        """Add a replica's counts for the same pass (its to_dict()); the pass's seconds are the runner's own."""
        for name in ("rows", "valid", "prompt_tokens", "output_tokens", "failed_output_tokens", "engine_starts",
                     "engine_start_s", "engine_steps", "engine_step_s"):
            setattr(self, name, getattr(self, name) + other.get(name, 0))
        self.hung += other.get("hung", 0)
        self.engine_close_s += other.get("engine_close_s", 0.0)
        self.reasons.update(other["reasons"])
        firsts = [t for t in (self.first_request_s, other.get("first_request_s")) if t is not None]
        self.first_request_s = min(firsts) if firsts else None
        for name, value in other["speculative"].items():
            self.speculative[name] = self.speculative.get(name, 0) + value
        self.grammar = self.grammar or other["grammar"]
        self.notice = self.notice or other.get("notice", "")
        self.auto += other.get("auto", [])
        self.recipe += other.get("recipe", [])
        for e in other.get("events", []):
            record(self.events, e["code"], e["text"])
        if other["note"] and other["note"] not in self.note:
            self.note = "; ".join(filter(None, (self.note, other["note"])))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["reasons"] = dict(self.reasons)
        d["engine_start_s"] = round(self.engine_start_s, 1)
        d["engine_close_s"] = round(self.engine_close_s, 1)
        d["engine_step_s"] = round(self.engine_step_s, 2)
        d["ms_per_step"] = round(1000 * self.engine_step_s / self.engine_steps, 1) if self.engine_steps else None
        if self.first_request_s is not None:
            d["first_request_s"] = round(self.first_request_s, 1)
        d["rows_per_s"] = round(self.rows / self.seconds, 3) if self.seconds else 0.0
        d["output_tokens_per_s"] = round(self.output_tokens / self.seconds, 1) if self.seconds else 0.0
        # The pass's wall time, engine start included: on a GPU that is what the pass costs.
        d["gpu_seconds_per_valid_row"] = round(self.seconds * self.replicas / self.valid, 4) if self.valid else None
        d["failed_output_token_share"] = round(self.failed_output_tokens / self.output_tokens, 3) if self.output_tokens else 0.0
        drafted = self.speculative.get("draft_tokens", 0)
        if drafted:
            d["acceptance"] = round(self.speculative["accepted_tokens"] / drafted, 3)
        return d


@dataclass
class RunReport:
    spec_hash: str
    input_rows: int
    output: str
    rejects: str
    resumed: bool = False
    interrupted: bool = False
    """Stopped by SIGTERM, Ctrl-C or `batchjson cancel`: finished units are committed, the next run resumes."""
    outcome: str = ""
    """How the run ended (storage/progress.py's Outcome): "done", "interrupted", "cancelled" or "deadline" (its
    deadline came with rows left: units in flight were finished and committed, the rest wait for the next run)."""
    rows_left: int = 0
    """Rows of this run's input (its shard's) in neither the output nor the rejects at its end."""
    passes: dict[str, PassStats] = field(default_factory=dict)
    valid_by_pass: dict = field(default_factory=dict)
    rejects_by_reason: dict = field(default_factory=dict)
    seconds: float = 0.0
    max_reject_rate: float = 0.0
    notes: list[str] = field(default_factory=list)
    events: list = field(default_factory=list)
    """The notes' codes: one {"code": NoteCode, "text": ...} per note of `notes`, in order."""
    verified: dict = field(default_factory=dict)
    """The exactly-once check that ends every run (see verify.py): ok, complete, problems."""
    verified_summary: str = ""
    replicas: int = 1
    """Engine replicas the passes ran on (one per GPU of the host by default)."""
    replicas_per_gpu: int = 0
    """Engine replicas on each GPU (tensor-parallel group); 0 without GPUs."""
    gpus: int = 0
    """GPUs the replicas ran on; 0 on a CPU engine."""
    gpu_hour_price: float | None = None
    """[report] gpu_hour_price: what a GPU-hour costs, for `cost()`'s price per 1,000 valid rows."""
    layout: str = ""
    """How the replicas sat on the GPUs and why (model.replicas_per_gpu, its "auto" rule): the summary's line."""
    timeline: dict = field(default_factory=dict)
    """Where the run's time went, in seconds: `before_run` from the process's start to the run's (imports, reading
    the spec); then from the run's start, `checked` (inputs read, folder claimed, resume checked), `passes` (both
    passes done, engines closed) and `verified` (the exactly-once check). `seconds` ends after the folder's release."""
    storage_retries: dict = field(default_factory=dict)
    """Reads of object storage that batchjson retried in this process, by the store's error (location.reading).
    pyarrow's own retries of each request are not in it: pyarrow reports none."""

    def note(self, code: NoteCode, text: str) -> None:
        """Add a note about the run (the summary's "note:" lines) and its code."""
        self.notes.append(text)
        record(self.events, code, text)

    def lay_out(self, layout) -> None:
        """Record where the replicas ran (an executors/placement.py Layout)."""
        self.replicas, self.replicas_per_gpu, self.layout = len(layout.placements), layout.per_gpu, layout.summary()
        named = {g for p in layout.placements if p.devices for g in p.devices.split(",")}
        self.gpus = len(named) or (-(-self.replicas // layout.per_gpu) if layout.per_gpu else 0)

    def cost(self) -> dict:
        """What this invocation's engines cost: engine-seconds (the passes' wall time, engine starts and closes
        included, x replicas), GPU-seconds (the same time x GPUs), those per 1,000 valid rows it made, prompt and
        output tokens per row it took in, and with gpu_hour_price the price per 1,000 valid rows."""
        window = max(0.0, self.timeline.get("passes", 0.0) - self.timeline.get("checked", 0.0))
        made = sum(p.valid for p in self.passes.values())
        first = self.passes.get(Stage.FIRST.label)
        rows = first.rows if first else 0  # rows taken in; a row pass 2 decoded again counts once, its tokens twice
        gpu_s = window * self.gpus
        per_1000 = round(gpu_s * 1000 / made, 2) if made and self.gpus else None
        d = {"engine_seconds": round(window * self.replicas, 1), "gpu_seconds": round(gpu_s, 1),
             "gpu_seconds_per_1000_valid": per_1000}
        for name in ("prompt_tokens", "output_tokens"):
            total = sum(getattr(p, name) for p in self.passes.values())
            d[f"{name}_per_row"] = round(total / rows, 1) if rows else None
        if self.gpu_hour_price is not None and per_1000 is not None:
            d["price_per_1000_valid"] = round(per_1000 / 3600 * self.gpu_hour_price, 4)
        return d

    def tally(self, records: list[dict]) -> None:
        """Count what the commit records of the folder say: the truth for the whole run, across resumes and shards."""
        valid: Counter = Counter()
        reasons: Counter = Counter()
        for r in records:
            valid[Stage(r["stage"]).label] += r["rows"].get("output", 0)
            reasons.update(r.get("reasons", {}))
        self.valid_by_pass = {k: v for k, v in sorted(valid.items()) if v}
        self.rejects_by_reason = dict(reasons.most_common())

    @property
    def verify_failed(self) -> bool:
        return bool(self.verified) and not self.verified.get("ok", True)

    @property
    def valid(self) -> int:
        return sum(self.valid_by_pass.values())

    @property
    def rejected(self) -> int:
        return sum(self.rejects_by_reason.values())

    @property
    def reject_rate(self) -> float:
        return self.rejected / self.input_rows if self.input_rows else 0.0

    @property
    def over_threshold(self) -> bool:
        return self.reject_rate > self.max_reject_rate

    def to_dict(self) -> dict:
        d = asdict(self)
        d["passes"] = {k: v.to_dict() for k, v in self.passes.items()}
        made = sum(p.valid for p in self.passes.values())
        d["gpu_seconds_per_valid_row"] = round(sum(p.seconds * p.replicas for p in self.passes.values()) / made, 4) \
            if made else None
        d["engine_starts"] = sum(p.engine_starts for p in self.passes.values())
        d["engine_start_s"] = round(sum(p.engine_start_s for p in self.passes.values()), 1)
        steps = sum(p.engine_steps for p in self.passes.values())
        d["engine_steps"] = steps
        d["ms_per_step"] = round(1000 * sum(p.engine_step_s for p in self.passes.values()) / steps, 1) if steps else None
        d["cost"] = self.cost()
        d |= {"valid": self.valid, "rejected": self.rejected, "rescued_by_fallback": self.valid_by_pass.get(RESCUED, 0),
              "reject_rate": round(self.reject_rate, 4), "over_threshold": self.over_threshold,
              "verify_failed": self.verify_failed}
        return d

    def summary(self) -> str:
        stopped = self.outcome if self.outcome not in ("", "done") else "interrupted" if self.interrupted else ""
        flags = ("  [resumed]" if self.resumed else "") + (
            f"  [{stopped}: {self.rows_left} rows left, rerun to resume]" if stopped else "")
        on = f" on {self.replicas} engine replicas" if self.replicas > 1 else ""
        lines = [f"{self.input_rows} input rows -> {self.valid} valid, {self.rejected} rejected "
                 f"({self.reject_rate:.1%}; threshold {self.max_reject_rate:.1%}){on}{flags}"]
        for name, p in self.passes.items():
            d = p.to_dict()
            acc = f", draft acceptance {d['acceptance']:.2f}" if "acceptance" in d else ""
            if p.speculative.get("audit_rows"):
                acc += (f", audit {p.speculative['audit_differ']:.0f} of {p.speculative['audit_rows']:.0f} rows "
                        "differ without drafts")
            reasons = ", ".join(f"{k} {v}" for k, v in p.reasons.most_common()) or "none"
            note = f"  ({p.note})" if p.note else ""
            cost = (f", {d['gpu_seconds_per_valid_row'] * 1000:.0f} ms per valid row"
                    if d["gpu_seconds_per_valid_row"] is not None else "")
            wasted = f", {d['failed_output_token_share']:.0%} of tokens on failed rows" if p.failed_output_tokens else ""
            lines.append(f"  {name}: {p.rows} rows, {p.valid} valid in {p.seconds:.1f}s ({d['rows_per_s']:.2f} rows/s, "
                         f"{d['output_tokens_per_s']:.0f} tok/s{acc}{cost}{wasted}); failed: {reasons}{note}")
            if p.grammar:
                lines.append(f"    grammar: {p.grammar}")
            for choice in p.auto:
                measured = "; ".join(
                    f"{t['method']} {t['output_tokens_per_s']:.0f} tok/s"
                    + (f", acceptance {t['acceptance']:.2f}" if "acceptance" in t else "") for t in choice["trials"])
                lines.append(f"    speculation: auto chose {choice['chosen']} ({choice['why']})"
                             + (f"; measured {measured}" if measured else ""))
            for judged in p.recipe:
                lines.append(f"    sampling: {judged['why']}")
        if self.layout:
            lines.append(f"  replicas: {self.layout}")
        starts = sum(p.engine_starts for p in self.passes.values())
        if starts:
            seconds = sum(p.engine_start_s for p in self.passes.values())
            first = min((p.first_request_s for p in self.passes.values() if p.first_request_s is not None),
                        default=None)
            to_first = f"; first request {first:.1f} s after start" if first is not None else ""
            steps = sum(p.engine_steps for p in self.passes.values())
            each = (f"; {steps:,} steps, {1000 * sum(p.engine_step_s for p in self.passes.values()) / steps:.1f} ms "
                    "a step" if steps else "")
            lines.append(f"  engine starts: {starts} ({seconds / starts:.1f} s each{to_first}){each}")
        if self.passes:
            lines.append(self._cost_line())
        if RESCUED in self.valid_by_pass:
            lines.append(f"  fallback rescued {self.valid_by_pass[RESCUED]} rows")
        if self.rejects_by_reason:
            lines.append("  rejects: " + ", ".join(f"{k} {v}" for k, v in self.rejects_by_reason.items()))
        lines += [f"  note: {n}" for n in dict.fromkeys(p.notice for p in self.passes.values() if p.notice)]
        lines += [f"  note: {n}" for n in self.notes]
        if self.storage_retries:
            kinds = ", ".join(f"{k} {v}" for k, v in self.storage_retries.items())
            lines.append(f"  object storage: {sum(self.storage_retries.values())} reads retried ({kinds}; pyarrow's "
                         "own retries are not counted)")
        if self.verified_summary:
            lines.append("  " + self.verified_summary.replace("\n", "\n  "))
        lines.append(f"  output {self.output}  rejects {self.rejects}  spec {self.spec_hash}")
        return "\n".join(lines)

    def _cost_line(self) -> str:
        c = self.cost()
        tokens = (f"{c['prompt_tokens_per_row']:.0f} prompt / {c['output_tokens_per_row']:.0f} output tokens per row"
                  if c["prompt_tokens_per_row"] is not None else "no rows taken in")
        if not self.gpus:
            return f"  cost: {c['engine_seconds']:.0f} engine-seconds (a CPU engine), {tokens}"
        per = (f", {c['gpu_seconds_per_1000_valid']:.1f} per 1,000 valid rows"
               if c["gpu_seconds_per_1000_valid"] is not None else "")
        price = (f"; {c['price_per_1000_valid']:.4f} per 1,000 valid rows at {self.gpu_hour_price} per GPU-hour"
                 if "price_per_1000_valid" in c else "")
        return f"  cost: {c['gpu_seconds']:.0f} GPU-seconds ({self.gpus} GPU(s)){per}, {tokens}{price}"
