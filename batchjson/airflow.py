"""Airflow: BatchJsonOperator runs a job, or one shard of it, as a task (the only module that imports airflow)."""

from __future__ import annotations

import re

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

INTERRUPTED = "interrupted (SIGTERM): finished units are committed; a retry resumes"


def shards(n: int) -> list[str]:
    """The shard arguments for n mapped tasks: `.expand(shard=shards(4))` covers the input exactly once."""
    return [f"{i}/{n}" for i in range(n)]


class BatchJsonOperator(BaseOperator):
    """Runs a batchjson job (`batchjson run JOB --output OUTPUT_DIR --input INPUT_PATH --shard I/N`) and returns its
    report.

    `job`, `output_dir`, `input_path` (overrides the spec's input.path) and `shard` are templated, so
    `output_dir=".../dt={{ ds }}"` gives each run date its own partition (`output`, the CLI's name, is taken: BaseOperator.output is the task's XCom). Running the task again
    for the same date never writes a row twice: by default it resumes the run already in `output_dir` (a finished
    run is a no-op); with `replace=True` it rebuilds the partition from scratch beside it and swaps it in, so
    readers never see rows of the old and the new partition mixed (on object storage, which has no renames, the
    swap deletes the old objects and copies the new ones in: see Storage.swap_in). If the run fails, is stopped or
    fails the exactly-once check, the old partition stays.

    The report (`RunReport.to_dict()`) is the task's return value. Rejects over the spec's output.max_reject_rate
    fail the task without retrying, since a retry would resume and find the same rejects; the report is then pushed
    as XCom `report`. Other failures honour the task's retries, and a retry resumes (with replace=True, starts the
    new partition over): a problem batchjson reports (bad spec, missing input, output in use, an engine that keeps
    dying) fails the task with batchjson's message alone, SIGTERM from Airflow stops the run keeping finished
    units, and anything else is a bug that keeps its traceback.

    `deadline` ("06:00", "8h", "2026-12-05T06:00"; default: the spec's output.deadline) stops the run taking units
    then: the units in flight are finished and committed, and the task fails without retrying (a retry would meet
    the same deadline), saying how many rows are left; clearing the task resumes. While the run goes, the task log
    gets a progress line a minute (rows finished, units, the rate), and `batchjson status` reads the partition.

    Engines: the task uses every GPU of its worker (one replica per GPU); `replicas` sets how many, and
    `ray="auto"` (or a cluster address) runs them as Ray actors over a cluster instead.

    Shards: map the task over `shards(N)`; each writes its own part files into the same `output_dir`. A shard's
    threshold check sees only the rejects written so far, so it can fail late but never wrongly; add one
    unsharded task on the same `output_dir` after the mapped ones: it finds every unit done, starts no engine,
    and reports on and checks the whole partition.
    """

    template_fields = ("job", "output_dir", "input_path", "shard", "deadline")

    def __init__(self, *, job: str, output_dir: str | None = None, input_path: str | None = None,
                 shard: str | None = None, replace: bool = False, replicas: int | None = None, ray: str | None = None,
                 deadline: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.job, self.output_dir, self.input_path = job, output_dir, input_path
        self.shard, self.replace = shard, replace
        self.deadline = deadline
        self.engines = {"replicas": replicas, "ray": ray}

    def execute(self, context):
        # Imported here, not at the top: the DAG processor parses DAG files often and needs none of this.
        from batchjson.errors import BatchjsonError
        from batchjson.job import run_job
        from batchjson.spec import load_spec, parse_shard, with_input

        shard = parse_shard(self.shard)
        try:
            spec = with_input(load_spec(self.job), self.input_path)
            if self.replace:
                report = self._replace(spec, shard, context["run_id"])
            else:
                report = run_job(spec, self.output_dir, shard=shard, deadline=self.deadline, **self.engines)
        except BatchjsonError as e:
            raise AirflowException(str(e)) from None
        if report.interrupted:  # run_job stops cleanly on SIGTERM (Airflow's kill) and returns: not a success
            raise AirflowException(INTERRUPTED)
        if report.outcome == "deadline":
            raise AirflowFailException(f"stopped at its deadline with {report.rows_left} rows left (units in flight "
                                       "were finished and committed); clear the task to resume" + (
                                           " (replace=True: the old partition stays, and a rerun starts over)"
                                           if self.replace else "") + f"\n{report.summary()}")
        result = report.to_dict()
        if report.verify_failed:  # not a retry's to fix: the folder needs a look (see the problems named)
            raise AirflowFailException(f"{report.output} does not hold each input row exactly once:\n"
                                       f"{report.verified_summary}")
        if report.over_threshold:
            context["ti"].xcom_push(key="report", value=result)  # a failed task has no return value
            raise AirflowFailException(f"rejects {report.reject_rate:.1%} exceed output.max_reject_rate "
                                       f"({report.max_reject_rate:.1%}); see {report.rejects}\n{report.summary()}")
        self.log.info("%s", report.summary())
        return result

    def _replace(self, spec, shard: tuple[int, int], run_id: str):
        """Run fresh into a hidden sibling of the partition, then swap it in (Storage.swap_in says what readers see
        meanwhile, locally and on object storage)."""
        from batchjson.ends import output_folder
        from batchjson.errors import SpecError
        from batchjson.job import run_job

        if shard != (0, 1):
            raise SpecError("replace=True rebuilds the whole partition, so it cannot run per shard. Leave replace "
                            "off for mapped shards (reruns resume), or clear the partition in a task before them.")
        if spec.output.rejects:
            raise SpecError("replace=True swaps the output folder whole, rejects included: remove output.rejects "
                            "from the spec so that rejects stay in <output>/_rejects.")
        if not (self.output_dir or spec.output.path):
            raise SpecError("no output folder: set output.path in the spec or pass output_dir.")
        final = output_folder(spec, self.output_dir)
        # Leading dot: dataset readers and `dt=*` globs skip the folder while it fills. Named by run, so a retry of
        # the same run reuses (and, being fresh, clears) what a killed try left.
        tag = re.sub(r"[^\w.-]", "_", run_id)
        tmp = final.output.with_name(f".{final.output.name}.tmp-{tag}")
        report = run_job(spec, tmp.uri, fresh=True, deadline=self.deadline, **self.engines)
        if report.interrupted:  # keep the old partition; the retry starts the new one over
            raise AirflowException(INTERRUPTED.replace("a retry resumes", "a retry rebuilds the partition"))
        if report.verify_failed or report.outcome == "deadline":  # keep the old partition; execute() fails the task
            return report
        report.output, report.rejects = str(final.output), str(final.rejects)
        output_folder(spec, tmp.uri).write_report(report.to_dict())  # the swap brings it along
        final.swap_in(tmp)
        return report
