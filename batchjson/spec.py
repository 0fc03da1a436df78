"""The job spec: jobs/*.toml read into frozen dataclasses, checked once at load.

Over 250 lines because each table's dataclass carries its own checks and a docstring per key: the spec is the
user's whole surface, and its messages name the key and what to do, in one place.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import string
import tomllib
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from batchjson.deadline import check_deadline
from batchjson.errors import SpecError
from batchjson.schema import pydantic_model
from batchjson.schema.files import checked, read, schema_file
from batchjson.schema.shape import bounded

IfExists = Literal["resume", "fail", "overwrite"]
GrammarFills = Literal["batch", "vllm"]
BACKEND_NAMES = ("auto", "xgrammar", "guidance", "outlines")
META_COLUMNS = ("_pass", "_finish_reason", "_prompt_tokens", "_output_tokens")
# Columns batchjson writes next to the id and pass-through columns (output, rejects, re-queue).
WRITTEN_COLUMNS = frozenset({"json", "reason", "detail", "raw_text", "prompt", *META_COLUMNS})
# The default loop guard of both passes (vLLM's RepetitionDetectionParams): stop a row once the tail of its output
# is a pattern of 8 to 64 tokens repeated 3 times: of the candidates measured on three extraction tasks, it stopped
# nearly every looping row and no valid one (BENCHMARKS.md, "Loop guard: which `repetition_detection`"). A short loop ("1.1.1.") is also a repeat of 8+ tokens, so min_pattern_size 8 still catches it, while
# legitimate short repeats (the digits of 10000) are left alone.
LOOP_GUARD = {"max_pattern_size": 64, "min_pattern_size": 8, "min_count": 3}
# The default for a schema that bounds every array (maxItems) and every string (maxLength, enum or const): the
# grammar ends such outputs by itself, and a row that fills an array with the same item is often right elsewhere.
# There LOOP_GUARD stops many valid rows and this one few, and it keeps more of the sample job's answers right
# (BENCHMARKS.md, "Loop guard: which `repetition_detection`", "Bounded schemas get a lighter default").
LOOP_GUARD_BOUNDED = {"max_pattern_size": 16, "min_pattern_size": 2, "min_count": 4}
# The spec's hash (JobSpec.fingerprint) counts every field but those declared out of it on the field: UNHASHED never
# counts; ADDED_LATER counts only off its default, so that a folder written before the key existed resumes under the
# hash it had.
UNHASHED = {"hash": "never"}
ADDED_LATER = {"hash": "off its default"}


def default_loop_guard(schema: dict | None) -> dict:
    return dict(LOOP_GUARD_BOUNDED if bounded(schema) else LOOP_GUARD)


def _require(cond: Any, message: str) -> None:
    if not cond:
        raise SpecError(message)


@dataclass(frozen=True)
class InputSpec:
    path: str
    """A Parquet file, a folder of them, or a glob; relative paths are taken from the spec file's folder."""
    id_column: str = "id"
    """Unique row key: output, rejects and resume are keyed by it, never by position. With generate_ids, the name of
    the column the generated ids are written to (the input must have no column of that name)."""
    generate_ids: bool = field(default=False, metadata=ADDED_LATER)
    """For inputs without an id column: each row's id is made from its place, "<file below the input root>:<row
    group>:<row>", the same on every run over the same files. A resume is refused, naming the file, when a file with
    committed units changed since (size, footer, or modification time or ETag); docs/spec.md, "Inputs without ids"."""
    passthrough: tuple[str, ...] = ()
    """Columns copied unchanged into the output and rejects."""
    batch_size: int = 1024
    """Rows per unit of work. Each unit is committed atomically, so smaller values lose less after a kill."""

    def __post_init__(self):
        _require(self.batch_size > 0, "input.batch_size must be > 0.")


@dataclass(frozen=True)
class PromptSpec:
    template: str = ""
    """User message with {column} placeholders, rendered through the model's chat template."""
    system: str = ""
    messages: str | None = field(default=None, metadata=ADDED_LATER)
    """Instead of template and system: a column whose rows are whole conversations, a list of {role, content}
    (system, user and assistant turns), rendered through the model's chat template as they are. For prompts written
    elsewhere, e.g. an OpenAI Batch file (`batchjson import-openai`)."""

    @property
    def columns(self) -> tuple[str, ...]:
        if self.messages:
            return (self.messages,)
        return tuple(dict.fromkeys(f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None))

    def __post_init__(self):
        if self.messages is not None:
            _require(self.messages, "prompt.messages must name a column.")
            _require(not self.template and not self.system, "prompt.messages is the whole prompt: leave out "
                     "prompt.template and prompt.system (put a system turn in the messages instead).")
            return
        _require(self.template, "[prompt] needs template (a user message with {column} placeholders) or messages "
                 "(a column of chat messages).")
        braces = "Write literal braces as {{ and }} (e.g. a JSON example: {{\"vendor\": \"...\"}})."
        try:
            fields = [(f, conv, fmt) for _, f, fmt, conv in string.Formatter().parse(self.template) if f is not None]
        except ValueError as e:
            raise SpecError(f"prompt.template: {e}. {braces}") from None
        for name, conv, fmt in fields:
            _require(name.isidentifier(), f"prompt.template: {{{name}}} is not a column name. Placeholders are plain "
                     f"column names like {{text}}. {braces}")
            _require(not conv and not fmt, f"prompt.template: {{{name}{'!' + conv if conv else ''}"
                     f"{':' + fmt if fmt else ''}}} has a conversion or format; placeholders are plain column names "
                     f"like {{{name}}}. {braces}")
        _require(fields, "prompt.template names no column: add a placeholder such as {text}.")


@dataclass(frozen=True)
class SchemaSpec:
    path: str | None = None
    """A JSON Schema file; relative paths are taken from the spec file's folder."""
    inline: dict | None = None
    """The JSON Schema as a TOML table, instead of `path`."""
    pydantic: str | None = field(default=None, metadata=UNHASHED)  # its schema (schema_doc) counts, not where it lives
    """A Pydantic model, 'package.module:Class', instead of `path`: imported from the spec file's folder first, then
    the installed packages; its model_json_schema() is the schema. In Python (build_job) the class itself."""
    json_object: bool = False
    """Any JSON object, no schema: the grammar only enforces JSON syntax."""
    check_format: bool = True
    """Validation asserts `format` (date-time, email, uri...) with every checker jsonschema has; false treats
    `format` as an annotation, as JSON Schema 2019-09 and later do by default."""


@dataclass(frozen=True)
class ModelSpec:
    path: str = "default"
    """A Hugging Face model folder, or "default" for the embedded SmolLM2-135M-Instruct."""
    dtype: str = "auto"
    max_model_len: int | None = None
    """Prompt plus output tokens; longer prompts are rejected per row as prompt_too_long."""
    structured_output_backend: str = "auto"
    """Grammar backend (auto, xgrammar, guidance, outlines); engine-wide in vLLM. "auto" picks, per job and pass, the
    first backend of a measured order that builds the schema's grammar in time (`batchjson check` says which)."""
    disable_any_whitespace: bool = True
    """Forbid whitespace between JSON tokens. Small models otherwise pad with spaces until max_tokens."""
    max_in_flight: int | None = field(default=None, metadata=UNHASHED)
    """Requests kept inside the engine at once; the engine is refilled as each one finishes. Unset: twice the
    engine's batch (vLLM's max_num_seqs: 1024 on an H100/H200, 256 on most others), so that its scheduler always has
    the next requests waiting while batchjson checks and commits finished ones."""
    hang_timeout_s: float = field(default=300.0, metadata=UNHASHED)
    """An engine with requests in flight that returns no step for this long is taken for hung (a deadlocked step, a
    stuck collective, a stopped process): its processes are killed and it is restarted like a dead engine, its rows
    decoded again, the death counted and the report noting "hung". The longest step seen on a GPU is well under a
    second and a CPU's prefill of a full batch a few seconds: raise it only for very long prompts on slow hardware."""
    grammar_fills: GrammarFills = field(default="batch", metadata=UNHASHED)  # the same masks either way
    """How the engine fills the grammar's masks each step: "batch" (xgrammar's batch matcher: one call per step, in
    C++ threads, into pinned buffers; engine/vllm/fills.py) or "vllm" (vLLM's own, a Python call per row). The same
    masks either way; "vllm" is for comparison, and is what runs on a vLLM version batchjson has not read."""
    engine: dict = field(default_factory=dict)
    """Any other vllm.LLM keyword argument, passed through unchanged (e.g. gpu_memory_utilization)."""
    # Where decoding runs does not change what a run writes.
    replicas: int | None = field(default=None, metadata=UNHASHED)
    """Engine replicas; unset: one per GPU of the host (per tensor_parallel_size GPUs), or one on a CPU; with
    replicas_per_gpu, that many per GPU."""
    replicas_per_gpu: int | str = field(default="auto", metadata=UNHASHED)
    """Engine replicas sharing each GPU (each tensor-parallel group of GPUs): each its own engine processes, its share
    of the GPU's memory (vLLM's gpu_memory_utilization divided among them, unless [model.engine] sets it) and of the
    host's cores. A small model leaves one engine CPU-bound and the GPU mostly idle. "auto": a count measured to pay
    for the model's size and the host's cores (executors/placement.py, REPLICAS_PER_GPU_RULE), else one."""

    def __post_init__(self):
        _require(self.structured_output_backend in BACKEND_NAMES,
                 f"model.structured_output_backend must be one of {list(BACKEND_NAMES)}, "
                 f"got {self.structured_output_backend!r}.")
        _require(self.max_in_flight is None or self.max_in_flight > 0, "model.max_in_flight must be > 0.")
        _require(self.grammar_fills in typing.get_args(GrammarFills),
                 f"model.grammar_fills must be one of {list(typing.get_args(GrammarFills))}, got {self.grammar_fills!r}.")
        _require(self.hang_timeout_s > 0, "model.hang_timeout_s must be > 0.")
        _require(self.replicas is None or self.replicas > 0, "model.replicas must be > 0.")
        _require(self.replicas_per_gpu == "auto" or (isinstance(self.replicas_per_gpu, int)
                                                     and self.replicas_per_gpu >= 1),
                 f'model.replicas_per_gpu must be "auto" or a whole number >= 1, got {self.replicas_per_gpu!r}.')
        _require(self.max_model_len is None or self.max_model_len > 0, "model.max_model_len must be > 0.")


@dataclass(frozen=True)
class SpeculativeSpec:
    method: str = "auto"
    """auto (measure on the job's rows and keep speculation only where it pays: see adapt/auto.py), none,
    ngram, suffix, draft_model, schema (batchjson's drafter: what the grammar forces, copies from the prompt), or
    another vLLM speculative method; the draft never carries the JSON constraint."""
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    """Draft model folder for method = "draft_model"; it must share the target's tokenizer."""
    draft_sample_method: str = "greedy"
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    options: dict = field(default_factory=dict)
    """Other speculative_config keys, passed through unchanged."""
    audit_rows: int = field(default=32, metadata=UNHASHED)  # an audit checks the outputs, it does not shape them
    """The speculation audit: pass 1's first rows decoded a second time without drafts on the same engine, where
    pass 1 is greedy; one whose two answers differ turns speculation off for the rest of the run. 0: no audit."""

    def __post_init__(self):
        _require(bool(self.method.strip()), "speculative.method is empty: use auto (the default), none, ngram, "
                 "suffix, draft_model, schema, or another of vLLM's speculative methods.")
        _require(self.num_speculative_tokens > 0, "speculative.num_speculative_tokens must be > 0.")
        _require(self.method != "draft_model" or self.draft_model,
                 'speculative.method = "draft_model" needs speculative.draft_model = "<model folder>".')
        _require(0 < self.prompt_lookup_min <= self.prompt_lookup_max,
                 "speculative.prompt_lookup_min must be > 0 and <= prompt_lookup_max.")
        _require(self.audit_rows >= 0, "speculative.audit_rows must be >= 0 (0: no audit).")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True)
class DecodingSpec:
    """Sampling settings of one pass. Pass 2 should differ from pass 1: greedy loops repeat under greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 512
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    repetition_detection: dict | bool = field(default_factory=lambda: dict(LOOP_GUARD))
    """The loop guard: stop a row once its output tail repeats a token pattern (vLLM's RepetitionDetectionParams:
    max_pattern_size, min_pattern_size, min_count); such rows fail as "repetition" instead of running to
    max_tokens. On by default: LOOP_GUARD, or LOOP_GUARD_BOUNDED for a schema that bounds every array and string;
    a table replaces the default whole, false turns the guard off."""
    n: int = 1
    """Fallback only: candidates sampled per row; the first that validates is kept. Costs up to n times the
    tokens: measured, it rescued fewer valid rows per GPU-second than n = 1 except on small fallbacks."""
    structured_output_backend: str | None = None
    """Fallback only: another grammar backend for pass 2 (default: the model's, "auto" unless set)."""
    enabled: bool = True
    """Fallback only: false sends pass-1 failures straight to rejects."""
    adapt: bool = field(default=True, metadata=UNHASHED)  # added later: folders written before resume as they were
    """Sampling only: when fewer than half of pass 1's first 100 rows are valid, pass 1 decodes the rest with the
    fallback's sampling settings (kept if they do better on the next 100; see adapt/recipe.py). False keeps pass 1 on
    these settings whatever its rows show."""

    def __post_init__(self):
        # vLLM's own ranges, checked at load so that a typo fails before an engine starts.
        _require(self.temperature >= 0, "temperature must be >= 0.")
        _require(0 < self.top_p <= 1, "top_p must be in (0, 1].")
        _require(self.max_tokens > 0, "max_tokens must be > 0.")
        _require(self.repetition_penalty > 0, "repetition_penalty must be > 0 (1.0 = off).")
        _require(-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2].")
        _require(-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2].")
        _require(self.structured_output_backend in (None, *BACKEND_NAMES),
                 f"structured_output_backend must be one of {list(BACKEND_NAMES)}, got {self.structured_output_backend!r}.")
        _require(self.n >= 1, "n must be >= 1.")
        guard = self.repetition_detection
        _require(guard is not True, "repetition_detection must be a table (max_pattern_size, min_pattern_size, "
                 "min_count) or false; leave it out for the default.")
        if isinstance(guard, dict):
            unknown = sorted(set(guard) - set(LOOP_GUARD))
            _require(not unknown, f"repetition_detection.{unknown[0] if unknown else ''} is unknown; allowed: "
                     f"{', '.join(LOOP_GUARD)}.")
            _require(all(isinstance(v, int) and not isinstance(v, bool) for v in guard.values()),
                     "repetition_detection values must be integers.")
            size, least, count = (guard.get(k, 0) for k in LOOP_GUARD)
            _require(size >= 1 and count >= 2 and least <= size,
                     "repetition_detection needs max_pattern_size >= 1, min_count >= 2 and "
                     "min_pattern_size <= max_pattern_size (or false to turn the loop guard off).")


@dataclass(frozen=True)
class OutputSpec:
    path: str | None = None
    """Folder of valid rows (Parquet parts). `batchjson run --output` overrides it."""
    rejects: str | None = None
    """Folder of rejected rows; default: <path>/_rejects (ignored by Parquet dataset readers)."""
    if_exists: IfExists = "resume"
    """What to do when the folder already holds a run: resume it, fail, or overwrite it."""
    max_reject_rate: float = 0.05
    """Exit code 3 when rejects exceed this fraction of the input."""
    deadline: str = ""
    """When a run stops taking units: "06:00" (the next 06:00), "8h" (after the start) or "2026-12-05T06:00".
    Units in flight then are finished and committed, the rest wait for the next run (exit code 4). `batchjson run
    --deadline` overrides it."""

    def __post_init__(self):
        _require(0 <= self.max_reject_rate <= 1, "output.max_reject_rate must be between 0 and 1.")
        if self.deadline:
            try:
                check_deadline(self.deadline)
            except ValueError as e:
                raise SpecError(f"output.deadline: {e}.") from None


@dataclass(frozen=True)
class ReportSpec:
    gpu_hour_price: float | None = None
    """What one GPU-hour costs you (any currency): the report then gives the price per 1,000 valid rows next to
    the GPU-seconds. Leaves the run's results and hash as they are."""

    def __post_init__(self):
        _require(self.gpu_hour_price is None or self.gpu_hour_price >= 0, "report.gpu_hour_price must be >= 0.")


@dataclass(frozen=True)
class JobSpec:
    input: InputSpec
    prompt: PromptSpec
    schema: SchemaSpec
    model: ModelSpec = ModelSpec()
    speculative: SpeculativeSpec = SpeculativeSpec()
    sampling: DecodingSpec = DecodingSpec()
    fallback: DecodingSpec = DecodingSpec(temperature=0.7, repetition_penalty=1.1, seed=0)
    output: OutputSpec = field(default=OutputSpec(), metadata=UNHASHED)
    report: ReportSpec = field(default=ReportSpec(), metadata=UNHASHED)
    source: str = field(default="", metadata=UNHASHED)
    """The spec file this was read from."""
    schema_doc: dict | None = None
    """The JSON Schema itself (loaded from schema.path or schema.inline); None for json_object."""

    def hash(self) -> str:
        """Hash of everything that shapes the results; the output and report sections and the file location are left
        out."""
        return hashlib.sha256(json.dumps(self.fingerprint(), sort_keys=True).encode()).hexdigest()[:16]

    def fingerprint(self) -> dict:
        """The fields the hash counts: all but those declared out of it (UNHASHED, ADDED_LATER)."""
        return _hashed(self)


def _hashed(obj: Any) -> dict:
    d = {}
    for f in dataclasses.fields(obj):
        value, how = getattr(obj, f.name), f.metadata.get("hash")
        if how is UNHASHED["hash"] or (how is ADDED_LATER["hash"] and value == f.default):
            continue
        d[f.name] = _hashed(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
    return d


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check one TOML value against a field's type hint; tuples come from TOML arrays."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(options) > 1:  # e.g. dict | bool: the first type the value fits
            for option in options:
                try:
                    return _coerce(value, option, key)
                except SpecError:
                    pass
            raise SpecError(f"{key} must be {' or '.join(getattr(o, '__name__', str(o)) for o in options)}, "
                            f"got {type(value).__name__} {value!r}.")
        hint = options[0]
        origin = typing.get_origin(hint)
    if origin is Literal:
        _require(value in typing.get_args(hint), f"{key} must be one of {list(typing.get_args(hint))}, got {value!r}.")
        return value
    if origin is tuple:
        _require(isinstance(value, list) and all(isinstance(v, str) for v in value),
                 f"{key} must be a list of strings, got {value!r}.")
        return tuple(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    ok = isinstance(value, hint) and not (hint is int and isinstance(value, bool))
    _require(ok, f"{key} must be {hint.__name__}, got {type(value).__name__} {value!r}.")
    return value


# Keys that earlier releases took and that changed only speed, never what a run writes: a spec that still sets one
# runs, with a warning to delete the line (a nightly job should not stop over a knob that had no effect on results).
REMOVED_KEYS = {
    "model": {"parallel_grammar": "the threaded grammar masks were removed: they ran no faster than vLLM's own "
                                  '(BENCHMARKS.md, "The parallel grammar masks, on and off in one call")'},
}


def _without_removed(table: Any, section: str) -> Any:
    if not isinstance(table, dict):
        return table
    for key, why in REMOVED_KEYS.get(section, {}).items():
        if key in table:
            warnings.warn(f"{section}.{key} is ignored: {why}. Delete the line from the spec.", stacklevel=3)
    return {k: v for k, v in table.items() if k not in REMOVED_KEYS.get(section, {})}


def _build(cls: type, table: Any, section: str, **defaults: Any) -> Any:
    _require(isinstance(table, dict), f"[{section}] must be a table.")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - names)
    if unknown:
        raise SpecError(f"unknown key {section}.{unknown[0]}; allowed keys in [{section}]: {', '.join(sorted(names))}.")
    kwargs = {**defaults}
    for k, v in table.items():
        kwargs[k] = _coerce(v, hints[k], f"{section}.{k}")
    missing = [f.name for f in dataclasses.fields(cls)
               if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise SpecError(f"[{section}] needs the key {missing[0]}.")
    try:
        return cls(**kwargs)
    except SpecError as e:
        raise SpecError(e.args[0] if e.args[0].startswith(section) else f"{section}.{e.args[0]}") from None


def _resolve(base: Path, path: str) -> str:
    """Relative paths in a spec are taken from the spec file's folder, so a job runs the same from any cwd. A URI
    (s3://bucket/prefix, gs://...) is left as it is."""
    if "://" in path:
        return path
    return os.path.normpath(base / os.path.expanduser(path))



def load_schema(spec: SchemaSpec, base: Path, model: type | None = None) -> dict | None:
    """Read and check the output JSON Schema (schema/files.py); None means any JSON object. `model`: the class of
    schema.pydantic, when the job was built in Python with the class itself."""
    given = [k for k in ("path", "inline", "pydantic") if getattr(spec, k)]
    given += ["json_object"] if spec.json_object else []
    _require(len(given) == 1, "[schema] needs exactly one of path, inline, pydantic or json_object = true"
             f"{f', got {given}' if given else ''}.")
    if spec.json_object:
        return None
    if spec.pydantic:
        doc = pydantic_model.json_schema(model or pydantic_model.load(spec.pydantic, base))
        try:
            return checked(doc, base)
        except SpecError as e:
            raise SpecError(f"schema.pydantic ({spec.pydantic}): {e}") from None
    if spec.inline:
        return checked(spec.inline, base)
    return schema_file(Path(_resolve(base, spec.path)))


def parse_spec(doc: dict, base: Path, source: str = "") -> JobSpec:
    """Build a JobSpec from a TOML document; relative paths in it are taken from `base`."""
    sections = {f.name for f in dataclasses.fields(JobSpec)} - {"source", "schema_doc"}
    unknown = sorted(set(doc) - sections)
    if unknown:
        raise SpecError(f"unknown section [{unknown[0]}]; allowed: {', '.join(sorted(sections))}.")
    for required in ("input", "prompt", "schema"):
        _require(required in doc, f"the spec needs an [{required}] section.")
    inp = _build(InputSpec, doc["input"], "input")
    table = doc["schema"]
    model_class = table.get("pydantic") if isinstance(table, dict) else None
    if isinstance(model_class, str):
        model_class = None
    elif model_class is not None:  # in Python: the class itself, named in the spec by its import path
        table = {**table, "pydantic": pydantic_model.reference(model_class)}
    schema = _build(SchemaSpec, table, "schema")
    out = _build(OutputSpec, doc.get("output", {}), "output")
    model = _build(ModelSpec, _without_removed(doc.get("model", {}), "model"), "model")
    spec = JobSpec(
        input=dataclasses.replace(inp, path=_resolve(base, inp.path)),
        prompt=_build(PromptSpec, doc["prompt"], "prompt"),
        schema=schema,
        model=model if model.path == "default" else dataclasses.replace(model, path=_resolve(base, model.path)),
        speculative=_build(SpeculativeSpec, doc.get("speculative", {}), "speculative"),
        sampling=_build(DecodingSpec, doc.get("sampling", {}), "sampling"),
        fallback=_build(DecodingSpec, doc.get("fallback", {}), "fallback",
                        **{k: getattr(JobSpec.fallback, k) for k in ("temperature", "repetition_penalty", "seed")}),
        output=dataclasses.replace(out, **{k: _resolve(base, getattr(out, k)) for k in ("path", "rejects")
                                           if getattr(out, k)}),
        report=_build(ReportSpec, doc.get("report", {}), "report"),
        source=source,
        schema_doc=load_schema(schema, base, model_class),
    )
    _require(spec.sampling.structured_output_backend is None,
             "sampling.structured_output_backend is not allowed: pass 1 uses model.structured_output_backend.")
    _require(spec.sampling.enabled, "sampling.enabled is not allowed: pass 1 always runs.")
    _require("adapt" not in (doc.get("fallback") or {}), "fallback.adapt is not allowed: it is pass 1's switch to the "
             "fallback's settings; set sampling.adapt.")
    taken = [c for c in spec.input.passthrough if c in WRITTEN_COLUMNS or c == spec.input.id_column]
    if taken:
        raise SpecError(f"input.passthrough: {taken[0]!r} is also the name of a column batchjson writes (or the id "
                        f"column); pass-through names must differ from {sorted(WRITTEN_COLUMNS)} and input.id_column. "
                        "Rename the column in the input, or leave it out.")
    _require(spec.sampling.n == 1, "sampling.n is not allowed: pass 1 makes one candidate per row (fallback.n can "
             "ask for more).")
    if spec.speculative.draft_model:
        spec = dataclasses.replace(spec, speculative=dataclasses.replace(
            spec.speculative, draft_model=_resolve(base, spec.speculative.draft_model)))
    # The loop guard a pass did not set is chosen from the schema (and so is part of the spec's hash).
    guard = default_loop_guard(spec.schema_doc)
    for name in ("sampling", "fallback"):
        if "repetition_detection" not in (doc.get(name) or {}):
            spec = dataclasses.replace(spec, **{name: dataclasses.replace(getattr(spec, name),
                                                                          repetition_detection=guard)})
    return spec


def with_input(spec: JobSpec, path: str | None) -> JobSpec:
    """The spec reading another input (a run-local override, e.g. a nightly pipeline's `input/dt=2026-11-30/`).

    The input path is part of the spec's hash: an output folder belongs to one input."""
    if not path:
        return spec
    path = path if "://" in path else os.path.abspath(path)
    return dataclasses.replace(spec, input=dataclasses.replace(spec.input, path=path))


def parse_shard(value: str | None) -> tuple[int, int]:
    """'I/N' -> (I, N): this run takes every N-th row group starting at the I-th. None means the whole input."""
    if not value:
        return (0, 1)
    try:
        i, n = (int(x) for x in str(value).split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise ValueError(f"shard: expected I/N with 0 <= I < N, e.g. 0/4; got {value!r}")
    return (i, n)


def load_spec(path: str | Path) -> JobSpec:
    """Read a job spec file. Raises SpecError naming the key and what is allowed."""
    path = Path(path)
    doc = read(path, tomllib.loads, tomllib.TOMLDecodeError, "the job spec")
    try:
        return parse_spec(doc, path.resolve().parent, str(path))
    except SpecError as e:
        raise SpecError(f"{path}: {e}") from None
