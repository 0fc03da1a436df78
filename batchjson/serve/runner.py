"""The batch queue: a batch's requests imported into jobs when it is created, then run one batch at a time, in the
order they were created, as batchjson jobs (run_job: resume, the exactly-once check), and exported as the Batch
API's output and error files.

A batch's life, as the Batch API names it: validating (imported, waiting its turn) -> in_progress (its jobs run) ->
finalizing (its files written) -> completed; or cancelling -> cancelled (`cancel_job`: the run stops at its next
engine step with finished units kept), or expired (the completion window is the run's deadline: no unit handed out
after it, units in flight finished). A cancelled or expired batch delivers what it finished; each request it did
not answer is a line of its error file (batch_cancelled, batch_expired), so each custom_id is in one file once.

Each step is written to the store before the next begins, so a server killed anywhere starts again where it was:
a batch not yet ended is queued again, its jobs resume (run_job keeps finished units), and its files are written
anew under the same ids.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import threading
import time
from pathlib import Path

from batchjson.deadline import DURATION
from batchjson.errors import BatchjsonError, InputError
from batchjson.serve.store import ENDPOINT, TERMINAL, NotFound, Store, new_id

MAX_REQUESTS = 50_000  # requests per batch: the Batch API's own limit
# How each way of stopping early ends the batch, and the error its unanswered requests get.
STOPPED = {"expired": "batch_expired", "cancelled": "batch_cancelled"}
RETRY_S = 5.0  # seconds before the runner tries again after an error outside any batch
CANCEL_POLL = 0.5  # seconds between tries to reach a run that is starting (its cancel marker needs a running run)
log = logging.getLogger("batchjson.serve")


class BadRequest(Exception):
    """A request the server refuses (HTTP 400): the message, and the parameter at fault."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def window_seconds(text) -> int:
    """A completion_window in seconds: the Batch API's "24h", or any duration the deadline takes ("2h", "90m",
    "1h30m", "45s"), for windows shorter than a day."""
    match = DURATION.fullmatch(text) if isinstance(text, str) and text else None
    seconds = sum(int(g or 0) * unit for g, unit in zip(match.groups(), (3600, 60, 1))) if match else 0
    if not seconds:
        raise BadRequest(f"completion_window must be \"24h\" (or a duration such as \"2h\", \"90m\"), got {text!r}.",
                         "completion_window")
    return seconds


def _metadata(value) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > 16 or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in value.items()):
        raise BadRequest("metadata must be an object of at most 16 string values (keys up to 64 characters, values "
                         "up to 512).", "metadata")
    return value


class Runner:
    """Creates, runs, cancels and reports batches; one thread runs them, one at a time."""

    def __init__(self, store: Store, model: str = "default", engine_factory=None, max_requests: int = MAX_REQUESTS):
        self.store, self.model, self.engines, self.max_requests = store, model, engine_factory, max_requests
        self._cond = threading.Condition()
        self._current: tuple[str, object] | None = None  # (batch id, the job spec now running)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # the HTTP side

    def create(self, body: dict) -> dict:
        """A new batch from the body of POST /v1/batches: its file imported into jobs (refused with BadRequest,
        naming the lines and fields, and nothing kept), then queued."""
        if not isinstance(body, dict):
            raise BadRequest("The body must be a JSON object.")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise BadRequest("input_file_id is required.", "input_file_id")
        if body.get("endpoint") != ENDPOINT:
            raise BadRequest(f"endpoint must be {ENDPOINT}: batchjson answers chat completions, got "
                             f"{body.get('endpoint')!r}.", "endpoint")
        window = window_seconds(body.get("completion_window"))
        metadata = _metadata(body.get("metadata"))
        try:
            file = self.store.file(file_id)
        except NotFound:
            raise BadRequest(f"No such File object: {file_id}", "input_file_id", status=404) from None
        if file["purpose"] != "batch":
            raise BadRequest(f"File {file_id} has purpose {file['purpose']!r}: a batch's input has purpose batch.",
                             "input_file_id")
        batch_id = new_id("batch_")
        work = self.store.work(batch_id)
        path = self.store.content(file_id)
        from batchjson.openai_batch import import_requests

        try:
            imported = import_requests(path, work, model=self.model)
        except InputError as e:  # the import removed what it wrote
            message = str(e).replace(str(path), f"file {file_id}").split("\nFix or remove")[0]
            raise BadRequest(f"{message}\nFix or remove these lines, upload the file again and create the batch "
                             "with it.", "input_file_id", "invalid_file") from None
        if imported.requests > self.max_requests:
            shutil.rmtree(work)
            raise BadRequest(f"file {file_id} holds {imported.requests} requests; a batch takes at most "
                             f"{self.max_requests} (serve --max-requests). Split it into several batches.",
                             "input_file_id", "too_many_requests")
        batch = self.store.add_batch(batch_id, file_id, body["completion_window"], window, imported.requests,
                                     metadata, _model_name(self.model))
        with self._cond:
            self._cond.notify()
        return batch

    def retrieve(self, batch_id: str) -> dict:
        """The batch, with the requests its running jobs have answered so far."""
        batch = self.store.batch(batch_id)
        if batch["status"] in ("in_progress", "cancelling", "finalizing"):
            done = self._counts(batch_id)
            if done:
                batch["request_counts"] |= done
        return batch

    def cancel(self, batch_id: str) -> dict:
        """Ask a batch to stop: a queued one ends now, a running one within seconds (its run's cancel)."""
        with self._cond:  # the runner takes its next batch under this lock: it is running this one, or never will
            batch = self.store.cancelling(batch_id)
            if batch["status"] in TERMINAL:
                raise BadRequest(f"Batch {batch_id} is {batch['status']}: it cannot be cancelled.", "batch_id")
            current = self._current
            if not current or current[0] != batch_id:  # waiting its turn: ends now, with what it finished
                self._finish(batch_id, "cancelled")
        if current and current[0] == batch_id:
            threading.Thread(target=self._cancel_run, args=(batch_id, current[1]), daemon=True,
                             name=f"cancel-{batch_id}").start()
        return self.store.batch(batch_id)

    # the queue

    def start(self) -> None:
        threading.Thread(target=_warm, name="batchjson-serve-warm", daemon=True).start()
        self._thread = threading.Thread(target=self._loop, name="batchjson-serve-runner", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Stop after the running job's units in flight (cancel_job); the batch stays in_progress, and the next
        server on this folder resumes it."""
        self._stopping.set()
        with self._cond:
            self._cond.notify_all()
            current = self._current
        if current:
            threading.Thread(target=self._cancel_run, args=(current[0], current[1]), daemon=True).start()
        if self._thread:
            self._thread.join(timeout)

    def _next(self) -> str | None:
        """The oldest batch not ended, marked as the one running (under the lock)."""
        waiting = [b for b in self.store.batches() if b["status"] not in TERMINAL]
        if not waiting:
            return None
        batch = min(waiting, key=lambda b: (b["created_at"], b["id"]))
        self._current = (batch["id"], None)
        return batch["id"]

    def _loop(self) -> None:
        """Run batches until the server stops. Nothing ends it early: an error in a batch fails that batch with its
        message, and anything else (the state folder unreadable a while) is logged and tried again."""
        while not self._stopping.is_set():
            try:
                self._run_next()
            except Exception:  # noqa: BLE001 -- the loop must outlive it: the server would take batches it never runs
                log.exception("the batch runner had an error; it goes on in %.0f s", RETRY_S)
                with self._cond:
                    self._current = None
                    self._cond.wait(RETRY_S)

    def _run_next(self) -> None:
        with self._cond:
            batch_id = self._next()
            if batch_id is None:
                self._cond.wait(5.0)
                return
        try:
            self._process(batch_id)
        except BatchjsonError as e:
            self.store.fail(batch_id, "run_failed", str(e))
        except OSError as e:  # the batch's files under --state
            log.exception("batch %s failed", batch_id)
            self.store.fail(batch_id, "server_error", f"the batch's files could not be read or written ({e}).")
        except Exception as e:  # a bug: its traceback goes to the log, the batch fails, the server serves on
            log.exception("batch %s failed", batch_id)
            self.store.fail(batch_id, "server_error",
                            f"internal error: {type(e).__name__}: {e}. See the server's log.")
        finally:
            with self._cond:
                self._current = None

    def _process(self, batch_id: str) -> None:
        from batchjson.api import load_job, run_job

        self.store.begin(batch_id)
        work = self.store.work(batch_id)
        stopped = None
        for name in _manifest(work)["jobs"]:
            batch = self.store.batch(batch_id)
            left = batch["expires_at"] - time.time()
            if batch["status"] == "cancelling":
                stopped = "cancelled"
                break
            if left <= 0:
                stopped = "expired"
                break
            if self._stopping.is_set():
                return
            spec = load_job(work / name / "job.toml")
            with self._cond:
                self._current = (batch_id, spec)
                cancel = self.store.batch(batch_id)["status"] == "cancelling"
            if cancel:  # cancelled between the look above and now
                stopped = "cancelled"
                break
            log.info("batch %s: running job %s", batch_id, name)
            report = run_job(spec, engine_factory=self.engines, progress=False, deadline=f"{math.ceil(left)}s")
            if report.interrupted:
                if self.store.batch(batch_id)["status"] == "cancelling":
                    stopped = "cancelled"
                    break
                return  # the server is stopping: the next one resumes the batch
            if report.outcome == "deadline":
                stopped = "expired"
                break
            if report.verify_failed:
                raise BatchjsonError(f"job {name}: {report.verified_summary}")
        if self.store.batch(batch_id)["status"] == "cancelling":
            stopped = "cancelled"
        self._finish(batch_id, stopped)

    def _finish(self, batch_id: str, stopped: str | None) -> None:
        """Write the batch's output and error files (what it finished; an error for each request it did not
        answer), then end it."""
        from batchjson.openai_batch import export_results

        self.store.finalizing(batch_id, stopped is not None)
        work = self.store.work(batch_id)
        staged = {kind: work / f"{kind}.jsonl" for kind in ("output", "error")}
        exported = export_results(work, staged["output"], staged["error"], unfinished=STOPPED.get(stopped))
        key = batch_id.removeprefix("batch_")
        ids = {}
        for kind, count in (("output", exported.answers), ("error", exported.failed)):
            if count:
                ids[kind] = self.store.add_file(staged[kind], f"{batch_id}_{kind}.jsonl", "batch_output",
                                                file_id=f"file-{key}-{kind}")["id"]
            else:
                staged[kind].unlink(missing_ok=True)
        status = stopped or "completed"
        self.store.end(batch_id, status, ids.get("output"), ids.get("error"), exported.answers, exported.failed)
        log.info("batch %s %s: %d answers, %d errors", batch_id, status, exported.answers, exported.failed)

    def _cancel_run(self, batch_id: str, spec) -> None:
        """Stop the running job through its cancel marker: tried until the run holds its folder (it may be
        starting) or the runner has moved on."""
        from batchjson.api import cancel_job

        while True:
            with self._cond:
                current = self._current
            if not current or current[0] != batch_id:
                return
            spec = current[1] or spec
            if spec is not None:
                try:
                    cancel_job(spec)
                    return
                except BatchjsonError:
                    pass  # not running yet (or ended): try again
            time.sleep(CANCEL_POLL)

    def _counts(self, batch_id: str) -> dict | None:
        """Requests answered (completed) and refused (failed) so far, from the jobs' status; None if unknown."""
        from batchjson.api import load_job, status_job
        from batchjson.ends import output_folder

        work = self.store.work(batch_id)
        completed = failed = 0
        try:
            for name in _manifest(work)["jobs"]:
                spec = load_job(work / name / "job.toml")
                if not output_folder(spec).state.exists():  # not started yet
                    continue
                status = status_job(spec)
                completed, failed = completed + status.valid, failed + status.rejected
        except (BatchjsonError, OSError, ValueError):
            return None
        return {"completed": completed, "failed": failed}


def _warm() -> None:
    """Import what the first batch's import and run would (the grammar backends take seconds), at the start."""
    from batchjson.schema.grammar import choose
    import batchjson.worker  # noqa: F401

    choose({"type": "object", "properties": {"a": {"type": "string"}}})


def _manifest(work: Path) -> dict:
    from batchjson.openai_batch.requests import MANIFEST

    return json.loads((work / MANIFEST).read_text())


def _model_name(model: str) -> str:
    from batchjson.openai_batch.responses import _model_name as name

    return name(model)
