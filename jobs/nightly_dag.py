"""Example DAGs: a nightly extraction into date partitions, with the operator, sharded, and as a plain command."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pendulum
from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import DAG

from batchjson.airflow import BatchJsonOperator, shards

# Use absolute paths: tasks do not run in this folder. Set these here, or through the environment of the DAG
# processor and the workers (the tests do that to run these DAGs on a tiny model).
HERE = Path(__file__).resolve().parent
JOB = os.environ.get("BATCHJSON_DAG_JOB", str(HERE / "sample.toml"))
OUT = os.environ.get("BATCHJSON_DAG_OUTPUT", str(HERE.parent / "out"))
GPU_NODES = int(os.environ.get("BATCHJSON_DAG_SHARDS", "4"))

# {{ ds }} is the run's logical date: each night writes (and a rerun revisits) its own dt= partition. Read all
# nights as one dataset: pyarrow from the <OUT>/invoices folder, DuckDB or Polars from <OUT>/invoices/dt=*/*.parquet
# with hive partitioning (a ** glob would also pick up the _rejects folders).
NIGHTLY = dict(schedule="0 2 * * *", start_date=pendulum.datetime(2026, 11, 1, tz="UTC"), catchup=False,
               tags=["batchjson"])

# 1. The operator. A rerun of a date resumes its partition and writes no row twice; replace=True would rebuild it
#    beside the old one and swap it in. The report is the task's XCom return value.
with DAG("batchjson_nightly", **NIGHTLY):
    BatchJsonOperator(task_id="extract", job=JOB, output_dir=OUT + "/invoices/dt={{ ds }}")

# 2. Sharded across GPU nodes: one mapped task per shard (route them to GPU workers with queue= or pool=), each
#    writing its own part files into the same partition. The unsharded task after them starts no engine: it finds
#    every unit done and reports on, and checks the rejects of, the whole partition.
with DAG("batchjson_nightly_sharded", **NIGHTLY):
    partition = OUT + "/invoices_sharded/dt={{ ds }}"
    extract = BatchJsonOperator.partial(task_id="extract", job=JOB, output_dir=partition)
    extract.expand(shard=shards(GPU_NODES)) >> BatchJsonOperator(task_id="check", job=JOB, output_dir=partition)

# 3. The plain command, side by side with 1 (`batchjson` must be on the workers' PATH). Any non-zero exit fails the
#    task and is retried alike: 3 rejects over output.max_reject_rate, 2 a problem to fix, 130 stopped by SIGTERM.
#    XCom gets only the last line printed. Add --shard I/N for the sharded form.
with DAG("batchjson_nightly_bash", **NIGHTLY):
    partition = shlex.quote(OUT + "/invoices_bash") + "/dt={{ ds }}"
    BashOperator(task_id="extract", bash_command=f"batchjson run {shlex.quote(JOB)} --output {partition}")
