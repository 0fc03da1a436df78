"""Command line: `batchjson run JOB.toml`, `batchjson check JOB.toml` and `batchjson verify JOB.toml`.

Exit codes: 0 done, rejects within output.max_reject_rate; 1 a bug (the traceback is printed); 2 bad spec, input
or output folder, or an engine that cannot start or keeps dying (the message says what to do); 3 done, but rejects
over output.max_reject_rate, or the exactly-once check failed (verify: not proven); 130 stopped by SIGTERM or
Ctrl-C (finished units are kept: rerun to resume).
"""

from __future__ import annotations

import json

import click

from batchjson.errors import BatchjsonError
from batchjson.spec import load_spec, parse_shard, with_input

EXIT_OK, EXIT_BUG, EXIT_USER, EXIT_REJECTS, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class UserError(click.ClickException):
    exit_code = EXIT_USER


def _user_error(e: BatchjsonError) -> UserError:
    error = UserError(str(e))
    error.exit_code = e.exit_code
    return error


def _shard(ctx, param, value):
    try:
        return parse_shard(value)
    except ValueError as e:
        raise click.BadParameter(str(e).removeprefix("shard: ")) from None


@click.group()
@click.version_option(package_name="batchjson")
def main():
    """Turn Parquet rows into schema-validated JSON with an LLM, in two passes, losing no row."""


@main.command()
@click.argument("job", type=click.Path(exists=True, dir_okay=False))
@click.option("--output", "-o", type=click.Path(file_okay=False), help="Output folder (overrides output.path).")
@click.option("--input", "input_path", type=click.Path(), help="Input file, folder or glob (overrides input.path).")
@click.option("--fresh", is_flag=True, help="Discard a run already in the output folder and start over.")
@click.option("--shard", callback=_shard, metavar="I/N", help="Process only shard I of N (whole row groups).")
@click.option("--replicas", type=click.IntRange(min=1), help="Engine replicas (default: one per GPU of the host).")
@click.option("--ray", "ray_address", is_flag=False, flag_value="auto", default=None, metavar="[ADDRESS]",
              help="Run the replicas as Ray actors on a cluster (RAY_ADDRESS, or a local one; or ADDRESS).")
@click.option("--json-report", is_flag=True, help="Print the JSON report instead of the summary.")
def run(job, output, input_path, fresh, shard, replicas, ray_address, json_report):
    """Run JOB (a TOML spec), or resume it where an earlier run stopped."""
    from batchjson.run import run_job

    try:
        report = run_job(with_input(load_spec(job), input_path), output, fresh=fresh, shard=shard,
                         replicas=replicas, ray=ray_address)
    except BatchjsonError as e:
        raise _user_error(e) from None
    click.echo(json.dumps(report.to_dict(), indent=2) if json_report else report.summary())
    if report.interrupted:
        click.echo("interrupted: finished units are committed; run the same command again to resume", err=True)
        raise SystemExit(EXIT_INTERRUPTED)
    if report.verify_failed:
        click.echo(f"{report.verified_summary}\nThe folder does not hold each input row exactly once; see the "
                   "problems above.", err=True)
        raise SystemExit(EXIT_REJECTS)
    if report.over_threshold:
        click.echo(f"rejects {report.reject_rate:.1%} exceed output.max_reject_rate; see {report.rejects}", err=True)
        raise SystemExit(EXIT_REJECTS)


def _schema_lines(spec) -> list[str]:
    """What `check` says about the schema: output columns, each pass's grammar backend and its coverage, formats."""
    from batchjson.errors import SpecError
    from batchjson.grammar import choose, coverage
    from batchjson.sink import typed_columns
    from batchjson.spec import is_object_root, root_types
    from batchjson.validate import FORMATS, unchecked_formats, used_formats

    schema, lines = spec.schema_doc, []
    if schema is not None and not is_object_root(schema):
        typed = typed_columns(schema, set())
        kind = "/".join(root_types(schema)) or "any JSON value"
        lines.append(f"schema: root {kind} -> output column json" + (
            f" and value ({typed['value']})" if typed else " (no typed column: the root does not map to one Arrow type)"))
    passes = [("pass1", spec.model.structured_output_backend)]
    if spec.fallback.enabled:
        passes.append(("pass2", spec.fallback.structured_output_backend or spec.model.structured_output_backend))
    seen = {}
    for name, backend in passes:
        choice = choose(schema, backend, spec.model.disable_any_whitespace)
        if not choice.backend:
            raise SpecError(f"{name}: {choice.reason}. Simplify the schema or set model.structured_output_backend.")
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
    return lines


@main.command()
@click.argument("job", type=click.Path(exists=True, dir_okay=False))
@click.option("--output", "-o", type=click.Path(), help="Output folder (overrides output.path).")
@click.option("--input", "input_path", type=click.Path(), help="Input file, folder or glob (overrides input.path).")
def check(job, output, input_path):
    """Check JOB's spec, schema, input and output folders without starting an engine."""
    from batchjson.source import ParquetSource
    from batchjson.storage import Storage

    try:
        spec = with_input(load_spec(job), input_path)
        source = ParquetSource(spec.input, spec.prompt.columns)
        rows = source.check()
        scan = source.scan()
        out = output or spec.output.path
        if out:
            storage = Storage(out, spec.output.rejects or None)
            storage.check_paths(spec.input.path)
            if (storage.state / "spec.json").exists():
                new = storage.check_inputs(scan.fingerprints, write=False)
                click.echo(f"resumes {out}: {len(new)} new input file(s)")
    except BatchjsonError as e:
        raise _user_error(e) from None
    click.echo(f"ok: {len(source.files)} file(s), {rows} rows, columns {source.columns}, spec {spec.hash()}")
    try:
        for line in _schema_lines(spec):
            click.echo(line)
    except BatchjsonError as e:
        raise _user_error(e) from None
    if scan.repeated:
        click.echo(f"warning: {len(scan.repeated)} ids occur more than once (e.g. {next(iter(scan.repeated))!r}); "
                   "only one occurrence of each is processed, the others are rejected as duplicate_id", err=True)


@main.command()
@click.argument("job", type=click.Path(exists=True, dir_okay=False))
@click.option("--output", "-o", type=click.Path(file_okay=False), help="Output folder (overrides output.path).")
@click.option("--input", "input_path", type=click.Path(), help="Input file, folder or glob (overrides input.path).")
def verify(job, output, input_path):
    """Prove that every input row of JOB is in exactly one of the output or the rejects of its output folder.

    Reads only id columns and the run state; starts no engine. Exit 0: proven; 3: not (the first offending ids
    are named), or the run is not finished yet."""
    from batchjson.verify import verify_job

    try:
        verdict = verify_job(with_input(load_spec(job), input_path), output)
    except BatchjsonError as e:
        raise _user_error(e) from None
    click.echo(verdict.summary())
    if not verdict.complete:
        if verdict.ok:
            click.echo("not finished: run the job again to resume, then verify.", err=True)
        raise SystemExit(EXIT_REJECTS)
