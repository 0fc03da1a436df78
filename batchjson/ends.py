"""A run's two ends: the input it reads and the output folder it writes, built here for every entry point (every
`Storage` of a job's folder is `output_folder`'s)."""

from __future__ import annotations

from batchjson.errors import SpecError
from batchjson.source import ParquetSource
from batchjson.spec import JobSpec
from batchjson.storage import Storage


def run_ends(spec: JobSpec, output: str | None = None, shard: tuple[int, int] = (0, 1), *,
             required: bool = True) -> tuple[ParquetSource, Storage | None]:
    """The job's input and its output folder (`output`, i.e. --output, else output.path; rejects where
    output.rejects says), as a run, a replica, `check`, `verify` and the OpenAI Batch export see them. The input
    files are listed; nothing is read or claimed. No output folder is a SpecError, or None when not `required`."""
    storage = output_folder(spec, output, shard, required=required)
    return ParquetSource(spec.input, spec.prompt.columns), storage


def output_folder(spec: JobSpec | None, output: str | None = None, shard: tuple[int, int] = (0, 1), *,
                  required: bool = True) -> Storage | None:
    """The job's output folder (`output`, else output.path; rejects where output.rejects says), as `run_ends` gives
    it, for those that need no input: the Airflow swap, the OpenAI Batch export, status and cancel (which may be
    given the folder `output` alone, no spec)."""
    out = output or (spec.output.path if spec else None)
    if not out and required:
        raise SpecError("no output folder: set output.path in the spec or pass --output." if spec else
                        "no output folder: pass --output OUT, or the job's TOML file (its output.path names one).")
    rejects = spec.output.rejects or None if spec else None
    return Storage(out, rejects, shard) if out else None
