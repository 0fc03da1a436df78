"""An OpenAI Batch requests file -> jobs: each request checked (refused, naming its line and field, where batchjson
would not answer it as the Batch API would), grouped by schema and sampling settings, written to Parquet a row
group at a time, with a job spec per group.

Over 350 lines because the import is one pass over the file: each request's check names its line, and the checks,
the grouping into jobs and the duplicate custom_ids share that pass's state (`_Problems`, the jobs being written)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchjson.errors import InputError, OutputError, SpecError, StorageFull, is_full
from batchjson.spec import DecodingSpec, SchemaSpec, load_schema

URL = "/v1/chat/completions"
MANIFEST = "openai_batch.json"  # read by responses.py
ROWS_PER_GROUP = 1024  # rows per Parquet row group, and the job's input.batch_size: a unit of work is a row group
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
INPUT_SCHEMA = pa.schema([("custom_id", pa.string()), ("line", pa.int64()), ("messages", pa.list_(MESSAGE))])
# Request body keys that map to the job's [sampling] (max_completion_tokens is the newer name of max_tokens).
SAMPLING = ("temperature", "top_p", "max_tokens", "seed", "frequency_penalty", "presence_penalty")
# OpenAI's defaults where a request leaves a key out: the requests were written against them. max_tokens has none
# there (the model's context), so batchjson's own default (512) applies.
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}
# Keys that do not change the answer. `model` names the hosted model: the job's [model] decides here.
IGNORED = frozenset({"model", "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                     "parallel_tool_calls"})
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
SHOWN = 10  # distinct problems named in a refusal


class Refused(Exception):
    """One request that does not fit a job: the field and why."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class _Job:
    """One job being written: the requests of one schema and one set of sampling settings."""

    name: str
    schema: dict | None  # None: response_format json_object
    schema_name: str
    sampling: dict
    writer: pq.ParquetWriter
    rows: list = field(default_factory=list)
    requests: int = 0

    def flush(self) -> None:
        if self.rows:
            self.writer.write_table(pa.Table.from_pylist(self.rows, INPUT_SCHEMA))
            self.rows = []


@dataclass
class Imported:
    """What import_requests wrote: the job specs (folder/<job>/job.toml) with their requests' counts."""

    folder: Path
    requests: int
    jobs: dict[str, int]

    def summary(self) -> str:
        lines = [f"imported {self.requests} requests into {len(self.jobs)} job(s) in {self.folder}:"]
        lines += [f"  {self.folder / name / 'job.toml'}  {n} requests" for name, n in self.jobs.items()]
        lines += ["next:"] + [f"  batchjson run {self.folder / name / 'job.toml'}" for name in self.jobs]
        lines.append(f"  batchjson export-openai {self.folder} results.jsonl --errors errors.jsonl")
        return "\n".join(lines)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Refused("body.messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"body.messages[{i}]"
        if not isinstance(m, dict):
            raise Refused(where, "must be an object with role and content")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise Refused(f"{where}.{extra[0]}", "is not supported: batchjson passes a message's role and content "
                          "only (no tool calls, names or audio)")
        if m.get("role") not in ROLES:
            raise Refused(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones, one after another
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise Refused(f"{where}.content[{j}]", "only text parts are supported ({type: text, text: ...})")
            content = "\n".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise Refused(f"{where}.content", "must be a string or a list of text parts")
        out.append({"role": ROLES[m["role"]], "content": content})
    return out


def _response_format(body: dict) -> tuple[str, dict | None]:
    """(the schema's name, the schema; None for json_object)."""
    fmt = body.get("response_format")
    if not isinstance(fmt, dict):
        raise Refused("body.response_format", "is missing: batchjson makes JSON; give each request a response_format "
                      "of type json_schema (or json_object)")
    if fmt.get("type") == "json_object":
        return "json_object", None
    if fmt.get("type") != "json_schema":
        raise Refused("body.response_format.type", f"must be json_schema or json_object, got {fmt.get('type')!r}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise Refused("body.response_format.json_schema.schema", "is missing or not an object")
    return str(spec.get("name") or "schema"), spec["schema"]


def _sampling(body: dict) -> dict:
    if "max_completion_tokens" in body:
        if "max_tokens" in body and body["max_tokens"] != body["max_completion_tokens"]:
            raise Refused("body.max_completion_tokens", "differs from body.max_tokens: give one of them")
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    return OPENAI_DEFAULTS | {k: body[k] for k in SAMPLING if body.get(k) is not None}


def parse_request(doc) -> tuple[str, list[dict], str, dict | None, dict]:
    """One request line, parsed: (custom_id, messages, schema name, schema, sampling). Refused for a request that
    batchjson would not answer as the Batch API would."""
    if not isinstance(doc, dict):
        raise Refused("", "is not a JSON object")
    extra = sorted(set(doc) - {"custom_id", "method", "url", "body"})
    if extra:
        raise Refused(extra[0], "is not a field of a Batch request (custom_id, method, url, body)")
    custom_id = doc.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise Refused("custom_id", "is missing or not a non-empty string")
    if doc.get("method", "POST") != "POST":
        raise Refused("method", f"must be POST, got {doc.get('method')!r}")
    if doc.get("url") != URL:
        raise Refused("url", f"must be {URL} (chat completions), got {doc.get('url')!r}")
    body = doc.get("body")
    if not isinstance(body, dict):
        raise Refused("body", "is missing or not an object")
    if body.get("n", 1) != 1:
        raise Refused("body.n", f"asks for {body['n']} answers per request; batchjson makes one")
    if body.get("stream", False) is not False:
        raise Refused("body.stream", "must be false in a batch")
    known = {"messages", "response_format", "n", "stream", "max_completion_tokens", *SAMPLING, *IGNORED}
    unknown = sorted(set(body) - known)
    if unknown:
        raise Refused(f"body.{unknown[0]}", "is not supported by batchjson (it would change the answer): remove it, "
                      "or send these requests elsewhere")
    name, schema = _response_format(body)
    return custom_id, _messages(body), name, schema, _sampling(body)


def _check_job(schema: dict | None, sampling: dict, folder: Path) -> None:
    """What `batchjson run` would refuse in the job, checked when its first request is read."""
    from batchjson.schema.grammar import choose

    try:
        doc = load_schema(SchemaSpec(json_object=True) if schema is None else SchemaSpec(inline=schema), folder)
    except SpecError as e:
        raise Refused("body.response_format.json_schema.schema", str(e)) from None
    choice = choose(doc, "auto", True)
    if not choice.backend:
        raise Refused("body.response_format.json_schema.schema", f"no grammar backend builds it: {choice.reason}")
    for key, value in sampling.items():
        whole = key in ("max_tokens", "seed")
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
            raise Refused(f"body.{key}", f"must be {'a whole number' if whole else 'a number'}, got {value!r}")
        try:
            DecodingSpec(**{key: value})
        except SpecError as e:
            raise Refused(f"body.{key}", str(e).removeprefix(f"{key} ")) from None


class _Problems:
    """Refused lines, alike ones counted together: a file where every line has the same fault names it once. Holds
    a count and two line numbers per distinct fault, whatever the file's size."""

    def __init__(self):
        self.seen: dict[tuple[str, str], list[int]] = {}  # (field, message) -> [lines, first line, second line]
        self.count = 0

    def add(self, line: int, fld: str, message: str) -> None:
        self.count += 1
        entry = self.seen.get((fld, message))
        if entry is None and len(self.seen) < SHOWN:
            self.seen[(fld, message)] = [1, line]
        elif entry is not None:
            entry[0] += 1
            entry[2:] = entry[2:] or [line]

    def error(self, path: str) -> InputError:
        shown = []
        for (fld, message), (n, first, *second) in self.seen.items():
            more = f" (and {n - 1} more lines like it, from line {second[0]} on)" if n > 1 else ""
            shown.append(f"line {first}: {fld + ': ' if fld else ''}{message}{more}")
        rest = self.count - sum(entry[0] for entry in self.seen.values())
        tail = f"\n  ... and {rest} more refused lines" if rest else ""
        return InputError(f"{path}: {self.count} request(s) cannot be imported, so nothing was written:\n  "
                          + "\n  ".join(shown) + tail + "\nFix or remove these lines (or move them to a file of "
                          "their own) and run import-openai again.")


def _job_name(name: str, taken: set[str]) -> str:
    stem = re.sub(r"[^A-Za-z0-9_-]+", "_", name)[:48].strip("_") or "schema"
    out, n = stem, 2
    while out in taken:
        out, n = f"{stem}-{n}", n + 1
    return out


def read_requests(lines):
    """Each non-blank line of a Batch requests file (bytes lines) as (its number, parse_request's answer), or (its
    number, the Refused that names why not)."""
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            try:
                doc = orjson.loads(raw)
            except orjson.JSONDecodeError as e:
                raise Refused("", f"is not valid JSON ({e})") from None
            yield number, parse_request(doc)
        except Refused as e:
            yield number, e


def import_requests(requests: str | Path, folder: str | Path, model: str = "default") -> Imported:
    """Write the jobs of an OpenAI Batch requests file into `folder` (new or empty): per job `<name>/job.toml`,
    `<name>/schema.json` and `<name>/input/requests.parquet` (custom_id, line, messages), and `openai_batch.json`
    (which lines went to which job) for export_results. Requests of other schemas or sampling settings go to
    other jobs; requests batchjson cannot answer as the Batch API would (n > 1, tools, another url, a duplicate
    custom_id, a bad line) make it refuse the file, naming each line and field, and write nothing."""
    requests, folder = Path(requests), Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise OutputError(f"{folder} is not an empty folder: import-openai writes its jobs into a new one.")
    made = not folder.exists()
    try:
        source = requests.open("rb")
    except OSError as e:
        raise InputError(f"{requests}: cannot be read ({e.strerror}).") from None
    folder.mkdir(parents=True, exist_ok=True)
    jobs: dict[bytes, _Job | Refused] = {}
    problems, total, keys = _Problems(), 0, array("Q")
    try:
        with source:
            for number, parsed in read_requests(source):
                total += 1
                try:
                    if isinstance(parsed, Refused):
                        raise parsed
                    custom_id, messages, name, schema, sampling = parsed
                    job = _job_for(jobs, folder, name, schema, sampling)
                except Refused as e:
                    problems.add(number, e.field, str(e))
                    continue
                if problems.count:  # refused already: read on to name every problem, write nothing more
                    continue
                job.rows.append({"custom_id": custom_id, "line": number, "messages": messages})
                job.requests += 1
                keys.append(_key(custom_id))
                if len(job.rows) >= ROWS_PER_GROUP:
                    job.flush()
        written = [j for j in jobs.values() if isinstance(j, _Job)]
        for job in written:
            job.flush()
            job.writer.close()
        if not problems.count:
            _duplicates(folder, written, keys, problems)
        if problems.count:
            raise problems.error(str(requests))
        if not total:
            raise InputError(f"{requests}: holds no request.")
        for job in written:
            _write_spec(folder / job.name, job, model, requests)
        manifest = {"requests": str(requests.resolve()), "count": total,
                    "jobs": {job.name: job.requests for job in written}}
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    except BaseException as e:  # a refusal, a full disk, Ctrl-C: no half-written jobs
        for job in jobs.values():
            if isinstance(job, _Job):
                job.writer.close()
        for path in [folder] if made else list(folder.iterdir()):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        if is_full(e):
            raise StorageFull.at(folder, e) from None
        raise
    return Imported(folder, total, {job.name: job.requests for job in written})


def _job_for(jobs: dict, folder: Path, name: str, schema: dict | None, sampling: dict) -> _Job:
    """The job of this schema and these sampling settings, begun (and checked) at its first request."""
    key = orjson.dumps([schema, sampling], option=orjson.OPT_SORT_KEYS)
    job = jobs.get(key)
    if job is None:
        try:
            _check_job(schema, sampling, folder)
            job_name = _job_name(name, {j.name for j in jobs.values() if isinstance(j, _Job)})
            (folder / job_name / "input").mkdir(parents=True)
            job = _Job(job_name, schema, name, sampling,
                       pq.ParquetWriter(folder / job_name / "input" / "requests.parquet", INPUT_SCHEMA))
        except Refused as e:
            job = e
        jobs[key] = job
    if isinstance(job, Refused):
        raise job
    return job


def _key(custom_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(custom_id.encode(), digest_size=8).digest(), "little")


def _duplicates(folder: Path, jobs: list[_Job], keys: array, problems: _Problems) -> None:
    """A custom_id on more than one line (of any job): the Batch API refuses such a file too. `keys` holds 8 bytes
    per request (a hash of its custom_id), not the ids: only the requests whose hash repeats are read back, to
    tell a repeated custom_id from a collision."""
    counts = pc.value_counts(pa.Array.from_buffers(pa.uint64(), len(keys), [None, pa.py_buffer(keys)]))
    repeated = set(counts.filter(pc.greater(counts.field("counts"), 1)).field("values").to_pylist())
    if not repeated:
        return
    lines: dict[str, list[int]] = {}
    for job in jobs:
        for batch in pq.ParquetFile(folder / job.name / "input" / "requests.parquet").iter_batches():
            for custom_id, line in zip(batch.column("custom_id").to_pylist(), batch.column("line").to_pylist()):
                if _key(custom_id) in repeated:
                    lines.setdefault(custom_id, []).append(line)
    for custom_id, where in sorted(lines.items(), key=lambda item: min(item[1])):
        first, *others = sorted(where)
        for line in others:
            problems.add(line, "custom_id", f"{custom_id!r} is also the custom_id of line {first}")


def _toml(value) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _write_spec(folder: Path, job: _Job, model: str, requests: Path) -> None:
    if job.schema is not None:
        (folder / "schema.json").write_text(json.dumps(job.schema, indent=2) + "\n")
    sampling = "\n".join(f"{k} = {_toml(v)}" for k, v in job.sampling.items())
    # The requests' max_tokens is their answer's budget: pass 2 keeps it rather than batchjson's larger default.
    fallback = f"max_tokens = {job.sampling['max_tokens']}\n" if "max_tokens" in job.sampling else ""
    (folder / "job.toml").write_text(f"""\
# {job.requests} requests of {requests.name} (response_format {job.schema_name}), written by batchjson import-openai.
# The requests' messages are the prompt; their model is not used: [model] decides.

[input]
path = "input"
id_column = "custom_id"
passthrough = ["line"]
batch_size = {ROWS_PER_GROUP}

[prompt]
messages = "messages"

[schema]
{'path = "schema.json"' if job.schema is not None else 'json_object = true'}

[model]
path = {_toml(model)}

# The requests' sampling settings (OpenAI's defaults where they set none).
[sampling]
{sampling}

[fallback]
{fallback}
[output]
path = "out"
""")


