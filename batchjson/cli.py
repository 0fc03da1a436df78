"""Command line: `batchjson run JOB.toml`, `batchjson check JOB.toml` and `batchjson verify JOB.toml`; a run seen
and stopped from anywhere: `batchjson status [JOB] --output OUT`, `batchjson cancel [JOB] --output OUT`; OpenAI Batch
files in and out: `batchjson import-openai REQUESTS.jsonl DIR`, `batchjson export-openai DIR OUT.jsonl`; the
Batch API itself: `batchjson serve --state DIR`.

Exit codes: 0 done, rejects within output.max_reject_rate; 1 a bug (the traceback is printed); 2 bad spec, input
or output folder, or an engine that cannot start or keeps dying (the message says what to do); 3 done, but rejects
over output.max_reject_rate, or the exactly-once check failed (verify: not proven); 4 stopped at its deadline
with rows left (units in flight were finished; rerun to resume); 130 stopped by SIGTERM, Ctrl-C or `batchjson
cancel` (finished units are kept: rerun to resume).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

import click

from batchjson.api import cancel_job, check_job, load_job, run_job, status_job, verify_job
from batchjson.errors import BatchjsonError
from batchjson.spec import parse_shard

EXIT_OK, EXIT_BUG, EXIT_USER, EXIT_REJECTS, EXIT_DEADLINE, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130


class UserError(click.ClickException):
    exit_code = EXIT_USER


def _user_error(e: BatchjsonError) -> UserError:
    error = UserError(str(e))
    error.exit_code = e.exit_code
    return error


def _shard(ctx, param, value):
    try:
        parse_shard(value)
    except ValueError as e:
        raise click.BadParameter(str(e).removeprefix("shard: ")) from None
    return value


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
@click.option("--deadline", metavar="WHEN", help='Stop taking units at WHEN: "06:00" (the next one), "8h" or '
              '"2026-12-05T06:00" (overrides output.deadline); exit 4 if rows are left then.')
@click.option("--json-report", is_flag=True, help="Print the JSON report instead of the summary.")
def run(job, output, input_path, fresh, shard, replicas, ray_address, deadline, json_report):
    """Run JOB (a TOML spec), or resume it where an earlier run stopped."""
    try:
        report = run_job(load_job(job), output, input_path=input_path, fresh=fresh, shard=shard, replicas=replicas,
                         ray=ray_address, deadline=deadline)
    except BatchjsonError as e:
        raise _user_error(e) from None
    click.echo(json.dumps(report.to_dict(), indent=2) if json_report else report.summary())
    if report.interrupted:
        click.echo(f"{report.outcome or 'interrupted'}: finished units are committed; run the same command again to "
                   "resume", err=True)
        raise SystemExit(EXIT_INTERRUPTED)
    if report.outcome == "deadline":
        click.echo(f"deadline: {report.rows_left} rows left; units in flight were finished and committed; run the "
                   "same command again to resume", err=True)
        raise SystemExit(EXIT_DEADLINE)
    if report.verify_failed:
        click.echo(f"{report.verified_summary}\nThe folder does not hold each input row exactly once; see the "
                   "problems above.", err=True)
        raise SystemExit(EXIT_REJECTS)
    if report.over_threshold:
        click.echo(f"rejects {report.reject_rate:.1%} exceed output.max_reject_rate; see {report.rejects}", err=True)
        raise SystemExit(EXIT_REJECTS)


@main.command()
@click.argument("job", type=click.Path(exists=True, dir_okay=False))
@click.option("--output", "-o", type=click.Path(), help="Output folder (overrides output.path).")
@click.option("--input", "input_path", type=click.Path(), help="Input file, folder or glob (overrides input.path).")
def check(job, output, input_path):
    """Check JOB's spec, model folder, schema, input and output folders without starting an engine."""
    try:
        result = check_job(load_job(job), output, input_path=input_path)
    except BatchjsonError as e:
        raise _user_error(e) from None
    click.echo(result.summary())
    for warning in result.warnings:
        click.echo(warning, err=True)


@main.command()
@click.argument("job", type=click.Path(exists=True, dir_okay=False))
@click.option("--output", "-o", type=click.Path(file_okay=False), help="Output folder (overrides output.path).")
@click.option("--input", "input_path", type=click.Path(), help="Input file, folder or glob (overrides input.path).")
def verify(job, output, input_path):
    """Prove that every input row of JOB is in exactly one of the output or the rejects of its output folder.

    Reads only id columns and the run state; starts no engine. Exit 0: proven; 3: not (the first offending ids
    are named), or the run is not finished yet."""
    try:
        verdict = verify_job(load_job(job), output, input_path=input_path)
    except BatchjsonError as e:
        raise _user_error(e) from None
    click.echo(verdict.summary())
    if not verdict.complete:
        if verdict.ok:
            click.echo("not finished: run the job again to resume, then verify.", err=True)
        raise SystemExit(EXIT_REJECTS)


def _folder_args(f):
    f = click.option("--output", "-o", help="Output folder or URI (default: the job's output.path).")(f)
    return click.argument("job", required=False, type=click.Path(exists=True, dir_okay=False))(f)


@main.command()
@_folder_args
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(job, output, as_json):
    """Say what the run in an output folder is doing, or how it ended: rows by pass and reason, units done and
    left, the recent rate and an ETA, and who holds the folder. Reads the folder only (no lock): safe beside a
    running run, from any machine."""
    try:
        found = status_job(load_job(job) if job else None, output)
    except BatchjsonError as e:
        raise _user_error(e) from None
    click.echo(json.dumps(found.to_dict(), indent=2) if as_json else found.summary())


@main.command()
@_folder_args
def cancel(job, output):
    """Stop the run that holds an output folder, from any shell or machine, as SIGTERM would: finished units stay
    committed and the next run resumes. Exit 2 when no run holds the folder."""
    try:
        click.echo(cancel_job(load_job(job) if job else None, output))
    except BatchjsonError as e:
        raise _user_error(e) from None


@main.command("import-openai")
@click.argument("requests", type=click.Path(exists=True, dir_okay=False))
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--model", default="default", show_default=True,
              help="The jobs' model.path: a Hugging Face model folder (the requests' own model is not used).")
def import_openai(requests, folder, model):
    """Turn an OpenAI Batch requests file (chat completions with a JSON Schema response_format) into jobs in
    FOLDER (new or empty): one per schema and sampling settings, each runnable with `batchjson run`.

    A request batchjson cannot answer as the Batch API would (n > 1, tools, another url, a duplicate custom_id,
    a line that does not parse) makes it refuse the whole file (exit 2), naming each line and field."""
    from batchjson.openai_batch import import_requests

    try:
        imported = import_requests(requests, folder, model=model if model == "default" else
                                   str(Path(model).resolve()))
    except BatchjsonError as e:
        raise _user_error(e) from None
    click.echo(imported.summary())


@main.command("export-openai")
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.argument("output", type=click.Path(dir_okay=False))
@click.option("--errors", type=click.Path(dir_okay=False),
              help="The error file: rejected requests (default: they are lines of OUTPUT, with response null).")
def export_openai(folder, output, errors):
    """Write the OpenAI Batch output file of FOLDER (what import-openai wrote) once its jobs are finished: one line
    per request, in the requests file's order; rejected requests as errors whose code is the reject reason.

    Each job is verified first (`batchjson verify`): an unfinished one is exit 2, naming it."""
    from batchjson.openai_batch import export_results

    try:
        exported = export_results(folder, output, errors)
    except BatchjsonError as e:
        raise _user_error(e) from None
    click.echo(exported.summary())


@main.command()
@click.option("--state", required=True, type=click.Path(file_okay=False),
              help="Folder of the server's files and batches (made if missing); a restarted server resumes from it.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. The server is for a trusted network: 0.0.0.0 opens it to every host "
              "that reaches this one, and needs --api-key (or --insecure).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--model", default="default", show_default=True,
              help="The model every batch runs on (the requests' own model is not used).")
@click.option("--api-key", envvar="BATCHJSON_API_KEY", metavar="KEY",
              help="Refuse requests without `Authorization: Bearer KEY` (401) [env BATCHJSON_API_KEY].")
@click.option("--max-requests", type=click.IntRange(min=1), default=50_000, show_default=True,
              help="Requests per batch; a larger file is refused when the batch is created (400).")
@click.option("--insecure", is_flag=True,
              help="Serve an address other hosts reach without --api-key (refused otherwise), on a trusted network.")
def serve(state, host, port, model, api_key, max_requests, insecure):
    """Serve OpenAI's Batch API (/v1/files, /v1/batches) on this host's GPUs: each batch runs as batchjson jobs,
    one batch at a time, each request once in its output or error file.

    Point the `openai` client's base_url at http://HOST:PORT/v1. A batch's completion_window ("24h", or a shorter
    duration such as "2h") is its deadline: it then ends as expired, with what it finished."""
    from batchjson.serve import serve as run_server

    try:
        run_server(state, host, port, model if model == "default" else str(Path(model).resolve()), api_key,
                   max_requests, insecure=insecure)
    except BatchjsonError as e:
        raise _user_error(e) from None


def entry() -> None:
    """The `batchjson` command (and `python -m batchjson`): `main`, then an exit without Python's teardown.

    Once a command has its exit code, every row is committed, the report written and the engines closed; what Python
    does next, finalizing the modules of torch, vLLM and pyarrow, took 2.9 s of a 12-row run on a CPU (and a GPU
    run's process lived ~4 s past its report, where bare vLLM's lived ~2 s past its last output). So the exit handlers
    run (logging, multiprocessing's children, Ray), the output is flushed, and the process ends. A bug's traceback
    (an exception click does not turn into an exit code) still takes Python's usual way out."""
    try:
        main()
        code = 0
    except SystemExit as done:  # click's standalone mode ends every command this way
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if isinstance(done.code, str):
            print(done.code, file=sys.stderr)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to say to it
            pass
    os._exit(code)
