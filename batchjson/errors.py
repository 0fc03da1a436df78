"""Errors the user can fix. Anything else that escapes is a bug and keeps its traceback."""


class BatchjsonError(Exception):
    """A problem the user can fix: the message says what went wrong, where, and what to do."""

    exit_code = 2


class SpecError(BatchjsonError):
    """The job spec (TOML) is malformed or names something that does not exist."""


class InputError(BatchjsonError):
    """The input Parquet data cannot be used as the spec describes."""


class OutputError(BatchjsonError):
    """The output folder cannot be written, or holds something this run must not touch."""


class StorageFault(BatchjsonError):
    """Object storage kept failing (throttling, 5xx, resets, timeouts) after pyarrow's retries: transient, so
    running the same command again resumes. Exit 2, as the other errors a rerun or a fix deals with."""


class ResumeConflict(OutputError):
    """The output folder holds a run of a different spec."""


class EngineError(BatchjsonError):
    """The inference engine cannot be started with this model or these settings."""


class EngineDied(Exception):
    """The engine process died mid-pass. Not the user's to fix: worker.py restarts the engine and re-feeds `in_flight`."""

    def __init__(self, in_flight: list, cause: BaseException | None = None):
        super().__init__(f"the engine died with {len(in_flight)} requests in flight: {cause!r}")
        self.in_flight = in_flight
