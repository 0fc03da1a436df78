"""The Python API: build or load a job, check it, run it, verify its output folder. `batchjson run`, `check` and
`verify` call these same functions, so a job run from a notebook or an orchestrator's task keeps every guarantee
of the command line: each input row ends in exactly one of the output or the rejects, and a rerun resumes.

Problems the user can fix (a bad spec, missing input, an output folder in use, an engine that cannot start) raise
a `BatchjsonError` whose message says what to do; the CLI turns it into exit code 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from batchjson.errors import SpecError
from batchjson.spec import JobSpec, load_spec, parse_shard, parse_spec, with_input

if TYPE_CHECKING:  # imported where used: the CLI imports this module, and `batchjson --help` needs no pyarrow
    from batchjson.report import RunReport
    from batchjson.engine.base import EngineFactory
    from batchjson.verify import Verdict
    from batchjson.status import Status


def load_job(path: str | Path) -> JobSpec:
    """Read a job spec file (TOML). Relative paths in it are taken from its folder; a bad key raises SpecError
    naming it."""
    return load_spec(path)


def build_job(base: str | Path = ".", **sections: dict) -> JobSpec:
    """A job built in Python: each keyword is a section of the TOML spec as a dict (input, prompt, schema, model,
    speculative, sampling, fallback, output), with the same keys, defaults and checks. Relative paths are taken
    from `base`. `schema={"pydantic": Invoice}` takes the Pydantic model class itself.

    The job is the same one its TOML would give (the same hash), so either can resume a folder the other began."""
    return parse_spec(sections, Path(base).resolve())


def run_job(job: JobSpec, output: str | None = None, *, input_path: str | None = None, fresh: bool = False,
            shard: str | None = None, replicas: int | None = None, ray: str | None = None,
            progress: bool | None = None, engine_factory: EngineFactory | None = None,
            deadline: str | None = None) -> RunReport:
    """Run a job into `output` (default: the spec's output.path), or resume the run already there.

    Returns the run report, also written to `<output>/_report.json`. The CLI's exit codes are fields of it:
    `over_threshold` (rejects above output.max_reject_rate), `verify_failed` (the exactly-once check at the end
    failed), `interrupted` (SIGTERM, Ctrl-C or `cancel_job`: finished units are kept, run again to resume) and
    `outcome` ("deadline": the deadline came with `rows_left`; units in flight were finished, run again to resume).

    `input_path` reads another input than the spec's (CLI: --input); `fresh` discards a run already in the folder;
    `shard="I/N"` processes every N-th row group from the I-th; `replicas` sets the engine replicas (default: one
    per GPU); `ray` runs them as Ray actors ("auto" or a cluster address); `deadline` ("06:00", "8h",
    "2026-12-05T06:00"; default: output.deadline) stops handing out units then; `progress` shows a progress bar (default:
    on a terminal only). `engine_factory`, an `engine.EngineFactory`, starts the engines (default: vLLM's,
    `engine.VllmEngines()`), for tests that share engines or fake one (`batchjson.engine.fake.FakeEngines()`
    answers without a model)."""
    from batchjson import job as run

    try:
        shards = parse_shard(shard)
    except ValueError as e:
        raise SpecError(str(e)) from None
    options = {"engine_factory": engine_factory} if engine_factory else {}
    return run.run_job(with_input(job, input_path), output, fresh=fresh, shard=shards, replicas=replicas, ray=ray,
                       progress=progress, deadline=deadline, **options)


def status_job(job: JobSpec | None = None, output: str | None = None) -> Status:
    """What the run in `output` (default: the job's output.path) is doing, or how it ended: rows by pass and
    reason, units done and left, the recent rate, an ETA, who holds the folder. Reads the folder only, taking no
    lock: safe beside a running run and from another machine. OutputError for a folder that cannot be read or
    holds no batchjson run."""
    from batchjson import status

    return status.status_job(job, output)


def cancel_job(job: JobSpec | None = None, output: str | None = None) -> str:
    """Stop the run that holds `output` as SIGTERM would, from anywhere: it sees the request within seconds;
    finished units stay committed and the next run resumes. OutputError when no run holds the folder."""
    from batchjson import status

    return status.cancel_job(job, output)


def verify_job(job: JobSpec, output: str | None = None, *, input_path: str | None = None) -> Verdict:
    """Check that every input row of `job` is in exactly one of the output or the rejects of `output` (default:
    the spec's output.path). Reads only id columns and the run state; starts no engine. `verdict.complete`: proven
    and finished; `verdict.ok` with pending units: nothing lost or doubled so far; else `verdict.problems` names the
    first offending ids or files."""
    from batchjson import verify

    return verify.verify_job(with_input(job, input_path), output)


@dataclass(frozen=True)
class CheckResult:
    """What `check_job` found; `summary()` is what `batchjson check` prints."""

    spec_hash: str
    files: int
    rows: int
    columns: list[str]
    """The input's columns."""
    typed_columns: dict[str, str]
    """Output columns the schema's properties (or a non-object root's `value`) get, with their Arrow types."""
    grammar: dict[str, str]
    """The grammar backend each pass would decode with, by the report's name of the pass (records.Stage.label)."""
    lines: list[str]
    warnings: list[str]
    """E.g. ids that occur more than once (the CLI prints these to stderr)."""

    def summary(self) -> str:
        return "\n".join(self.lines)


def check_job(job: JobSpec, output: str | None = None, *, input_path: str | None = None) -> CheckResult:
    """Check a job without starting an engine: its input (files, columns, ids), its output folder (and what a run there
    would resume), the installed vLLM (batchjson's engine patches on there, and each one off, and why), and its schema
    (output columns, each pass's grammar backend and what it enforces, formats nothing checks). Raises BatchjsonError on
    what a run would fail on."""
    from batchjson.ends import run_ends

    spec = with_input(job, input_path)
    source, storage = run_ends(spec, output, required=False)
    rows = source.check()
    scan = source.scan()
    lines, warnings = [], []
    if storage:
        storage.check_paths(spec.input.path)
        if storage.spec_file.exists():
            new = storage.check_inputs(scan.fingerprints, write=False)
            lines.append(f"resumes {storage.output}: {len(new)} new input file(s)")
    from batchjson.engine.models import check_model

    lines.append(check_model(spec.model.path))
    if spec.speculative.draft_model:
        from batchjson.engine import check_draft

        check_draft(spec.model.path, spec.speculative.draft_model)
        lines.append(f"draft model {spec.speculative.draft_model}: the target's tokenizer and vocabulary")
    lines.append(f"ok: {len(source.files)} file(s), {rows} rows, columns {source.columns}, spec {spec.hash()}")
    from batchjson.engine.vllm.versions import check_lines

    lines += check_lines()
    typed, grammar, schema_lines = _schema(spec)
    if scan.repeated:
        warnings.append(f"warning: {len(scan.repeated)} ids occur more than once (e.g. {next(iter(scan.repeated))!r}); "
                        "only one occurrence of each is processed, the others are rejected as duplicate_id")
    return CheckResult(spec.hash(), len(source.files), rows, list(source.columns), typed, grammar,
                       lines + schema_lines, warnings)


def _schema(spec: JobSpec) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """What `check` says about the schema: the typed output columns, each pass's grammar backend, and the lines
    that say so (with each backend's coverage, and formats)."""
    from batchjson.records import Stage
    from batchjson.schema.grammar import choose, coverage
    from batchjson.schema.shape import is_object_root, root_types
    from batchjson.schema.validate import FORMATS, unchecked_formats, used_formats
    from batchjson.schema.arrow import typed_columns
    from batchjson.tables import reserved

    schema, lines = spec.schema_doc, []
    columns = typed_columns(schema, reserved(spec.input.id_column, spec.input.passthrough))
    typed = {name: str(kind) for name, kind in columns.items()}
    if schema is not None and not is_object_root(schema):
        kind = "/".join(root_types(schema)) or "any JSON value"
        mapped = (f" and value ({typed['value']})" if typed
                  else " (no typed column: the root does not map to one Arrow type)")
        lines.append(f"schema: root {kind} -> output column json{mapped}")
    elif schema is not None:
        json_only = [name for name in schema.get("properties") or {} if name not in typed]
        lines.append("schema: root object -> output column json and typed columns "
                     + (", ".join(f"{name} ({kind})" for name, kind in typed.items()) or "none")
                     + (f"; only in json: {', '.join(json_only)}" if json_only else ""))
    passes = [(Stage.FIRST.label, spec.model.structured_output_backend)]
    if spec.fallback.enabled:
        passes.append((Stage.SECOND.label,
                       spec.fallback.structured_output_backend or spec.model.structured_output_backend))
    seen, grammar = {}, {}
    for name, backend in passes:
        choice = choose(schema, backend, spec.model.disable_any_whitespace)
        if not choice.backend:
            raise SpecError(f"{name}: {choice.reason}. Simplify the schema or set model.structured_output_backend.")
        grammar[name] = choice.backend
        if backend in seen:
            lines.append(f"{name} grammar: same as {seen[backend]}")
            continue
        seen[backend] = name
        lines.append(f"{name} grammar: {choice.summary}")
        lines += [f"  {line}" for line in coverage(schema, choice).lines()]
    used = sorted(used_formats(schema))
    if used and not spec.schema.check_format:
        lines.append(f"format: not asserted (schema.check_format = false): {', '.join(used)}")
    elif used:
        nobody = unchecked_formats(schema)
        checked = [f for f in used if f in FORMATS.checkers]
        if checked:
            lines.append(f"format: validation checks {', '.join(checked)}")
        if nobody:
            lines.append(f"format: nothing checks {', '.join(nobody)} (no checker exists): check such values "
                         "downstream, or add a pattern to the schema")
    return typed, grammar, lines
