"""Finished jobs of an import -> the OpenAI Batch output file (and its error file), in the requests file's order:
each job verified, then its units read one at a time and the jobs merged by line number."""

from __future__ import annotations

import hashlib
import heapq
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from batchjson.errors import InputError, OutputError, StorageFull, is_full
from batchjson.openai_batch.requests import MANIFEST
from batchjson.spec import load_spec


@dataclass
class Exported:
    """What export_results wrote: answers (valid rows) and errors (rejected rows)."""

    output: Path
    errors: Path
    answers: int
    failed: int

    def summary(self) -> str:
        if self.errors == self.output:
            return f"wrote {self.answers} answers and {self.failed} errors to {self.output}, in the requests' order"
        return (f"wrote {self.answers} answers to {self.output} and {self.failed} errors to {self.errors}, in the "
                "requests' order")


OUTPUT_COLUMNS = {"output": ["custom_id", "line", "json", "_finish_reason", "_prompt_tokens", "_output_tokens"],
                  "rejects": ["custom_id", "line", "reason", "detail"]}


def _rows(spec) -> Iterator[tuple[int, str, dict]]:
    """A finished job's rows, in line order: (line, kind, row). One unit of work in memory at a time: the units
    are row groups of requests in line order, and each unit's rows are in its part files of both passes."""
    from batchjson.ends import run_ends
    from batchjson.records import Stage
    from batchjson.storage import Unreadable

    source, storage = run_ends(spec)
    commits = storage.commits
    for ref in source.plan():
        rows = []
        for stage in Stage:
            for kind in (commits.record(stage, ref.key) or {}).get("files", {}):
                if kind in OUTPUT_COLUMNS:
                    try:
                        table = commits.read_ids(stage, ref.key, kind, OUTPUT_COLUMNS[kind])
                    except (FileNotFoundError, Unreadable) as e:
                        raise OutputError(f"{spec.source}: unit {ref.key}: {e}. Run `batchjson verify {spec.source}`"
                                          " and `batchjson run` (it redoes the unit), then export again.") from None
                    rows += [(row["line"], kind, row) for row in table.to_pylist()]
        rows.sort(key=lambda r: r[0])
        yield from rows


def _model_name(path: str) -> str:
    """The completion's `model`: the model folder's name ("SmolLM2-135M-Instruct" for the embedded default)."""
    from batchjson.engine.models import DEFAULT_MODEL_PACKAGE

    return DEFAULT_MODEL_PACKAGE[1].split(".")[0] if path == "default" else Path(path).name


def _line(kind: str, row: dict, spec_hash: str, model: str, created: int) -> bytes:
    digest = hashlib.sha256(f"{spec_hash}\x00{row['custom_id']}".encode()).hexdigest()
    out = {"id": f"batch_req_{digest[:32]}", "custom_id": row["custom_id"], "response": None, "error": None}
    if kind == "rejects":
        out["error"] = {"code": row["reason"], "message": row["detail"] or row["reason"]}
        return orjson.dumps(out)
    prompt, completion = row["_prompt_tokens"] or 0, row["_output_tokens"] or 0
    body = {"id": f"chatcmpl-{digest[32:56]}", "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": row["json"], "refusal": None},
                         "logprobs": None, "finish_reason": "length" if row["_finish_reason"] == "length" else "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
            "system_fingerprint": f"batchjson_{spec_hash}"}
    out["response"] = {"status_code": 200, "request_id": digest[:32], "body": body}
    return orjson.dumps(out)


def _lines(spec) -> Iterator[tuple[int, str, bytes]]:
    """A finished job's lines of the output format, in line order: (line number, kind, the line)."""
    from batchjson.ends import output_folder

    report = output_folder(spec).report_path()
    created = int(report.info().mtime.timestamp()) if report.exists() else 0  # when the run ended: the same again
    spec_hash, model = spec.hash(), _model_name(spec.model.path)
    for line, kind, row in _rows(spec):
        yield line, kind, _line(kind, row, spec_hash, model, created)


def _finished(toml: Path, partial: bool = False):
    """A job of the import, finished with each of its rows once in output or rejects: as the exactly-once check
    that ended its run found (its _report.json), else as `batchjson verify` finds now. The export then checks
    again, in flat memory, that it writes each line number of the requests file once (verify holds every id).
    `partial`: a job stopped early (or never run: None) will do, if nothing in it is lost or doubled."""
    from batchjson.ends import output_folder
    from batchjson.verify import verify_job

    spec = load_spec(toml)
    storage = output_folder(spec)
    if not storage.spec_file.exists():
        if partial:
            return None
        raise OutputError(f"{toml}: not run yet. Run `batchjson run {toml}`, then export again.")
    try:
        if storage.report_path().read_json().get("verified", {}).get("complete"):
            return spec
    except (OSError, ValueError):
        pass  # no report (a sharded run writes one per shard, an interrupted one none): verify
    verdict = verify_job(spec)
    if not (verdict.ok if partial else verdict.complete):
        what = verdict.summary() if not verdict.ok else "it is not finished"
        raise OutputError(f"{toml}: {what}. Run `batchjson run {toml}` (it resumes), then export again.")
    return spec


# The error a request gets that a stopped batch did not answer, by the reason it stopped (the Batch API's codes).
UNFINISHED = {"batch_expired": "This request could not be executed before the completion window expired.",
              "batch_cancelled": "This request was not executed: the batch was cancelled."}


def _requests(spec) -> Iterator[tuple[int, str]]:
    """A job's requests in line order: (line, custom_id), one row group at a time."""
    import pyarrow.dataset as ds

    for batch in ds.dataset(spec.input.path, format="parquet").to_batches(columns=["line", "custom_id"]):
        yield from zip(batch.column("line").to_pylist(), batch.column("custom_id").to_pylist())


def _unanswered(answers: Iterator[tuple[int, str, bytes]], requests: Iterator[tuple[int, str]],
                code: str) -> Iterator[tuple[int, str, bytes]]:
    """The answers, and an error of `code` in its place for each request that has none (both in line order)."""
    pending = next(answers, None)
    for line, custom_id in requests:
        while pending is not None and pending[0] < line:  # a line no request has: the check after the merge fails
            yield pending
            pending = next(answers, None)
        if pending is not None and pending[0] == line:
            yield pending
            pending = next(answers, None)
            continue
        digest = hashlib.sha256(f"{code}\x00{custom_id}".encode()).hexdigest()
        yield line, "rejects", orjson.dumps({"id": f"batch_req_{digest[:32]}", "custom_id": custom_id,
                                             "response": None, "error": {"code": code, "message": UNFINISHED[code]}})
    if pending is not None:
        yield pending
        yield from answers


def export_results(folder: str | Path, output: str | Path, errors: str | Path | None = None, *,
                   unfinished: str | None = None) -> Exported:
    """Write the Batch output file of a folder import_requests wrote, once its jobs are finished: one line per
    request, in the requests file's order; a valid row as a chat.completion (the JSON as the message's content,
    its finish_reason and token usage), a rejected one as an error whose code is its reject reason. Errors go
    to `errors`, or without it into `output` (response null, error set). Both files are written under a temporary
    name and renamed at the end, so a failed export leaves none half written.

    `unfinished` ("batch_expired" or "batch_cancelled"): the jobs may have stopped early (a deadline, a cancel);
    what they finished is written as above, and each request they did not answer gets an error of that code, so
    each request still has exactly one line."""
    folder, output = Path(folder), Path(output)
    errors = Path(errors) if errors else output
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        raise InputError(f"{folder}: no {MANIFEST} here. Give the folder import-openai wrote.") from None
    if unfinished is not None and unfinished not in UNFINISHED:
        raise ValueError(f"unfinished must be one of {', '.join(UNFINISHED)}, not {unfinished!r}")
    jobs = [folder / name / "job.toml" for name in manifest["jobs"]]
    specs = [(toml, _finished(toml, partial=unfinished is not None)) for toml in jobs]
    merged = heapq.merge(*[_lines(spec) for _, spec in specs if spec is not None], key=lambda r: r[0])
    if unfinished is not None:
        requests = heapq.merge(*[_requests(spec or load_spec(toml)) for toml, spec in specs], key=lambda r: r[0])
        merged = _unanswered(merged, requests, unfinished)
    staged = {path: path.with_name(f".{path.name}.tmp") for path in {output, errors}}
    files = {}
    try:
        for path in staged:
            files[path] = staged[path].open("wb")
    except OSError as e:
        for f in files.values():
            f.close()
        raise OutputError(f"cannot write {e.filename}: {e.strerror}. Check that its folder exists.") from None
    counts = {"output": 0, "rejects": 0}
    last = 0
    try:
        changed = (f"The jobs' output folders changed since their runs: run `batchjson verify` on the jobs of "
                   f"{folder}, and `batchjson run` on those it finds incomplete, then export again.")
        for line, kind, text in merged:
            if line <= last:
                raise OutputError(f"line {line} of the requests has two answers. {changed}")
            last = line
            counts[kind] += 1
            files[output if kind == "output" else errors].write(text + b"\n")
        if sum(counts.values()) != manifest["count"]:
            raise OutputError(f"{sum(counts.values())} of the {manifest['count']} requests have an answer or an "
                              f"error. {changed}")
        for path, f in files.items():
            f.close()
            os.replace(staged[path], path)
    except BaseException as e:
        for path, f in files.items():
            f.close()
            staged[path].unlink(missing_ok=True)
        if is_full(e):
            raise StorageFull.at(e.filename or output, e) from None
        raise
    return Exported(output, errors, counts["output"], counts["rejects"])

