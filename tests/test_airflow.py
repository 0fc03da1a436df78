"""The operator and the example DAGs in a real Airflow 3: SQLite metadata in a temporary AIRFLOW_HOME, dag.test()."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from pyarrow import fs

from helpers import SCRATCH, write_job, write_rows
from batchjson.engine.fake import FakeEngines

# Airflow reads its configuration once, on import: point it at a throwaway home first, as dlt's Airflow tests do.
# dag.test() runs only DAGs that its dags folder holds, so the example DAG file is copied there.
HOME = Path(tempfile.mkdtemp(prefix="airflow-", dir=SCRATCH))
atexit.register(shutil.rmtree, HOME, True)
DAGS = HOME / "dags"
DAGS.mkdir()
os.environ.update(AIRFLOW_HOME=str(HOME), AIRFLOW__CORE__DAGS_FOLDER=str(DAGS), AIRFLOW__CORE__LOAD_EXAMPLES="False",
                  AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{HOME}/airflow.db")
pytest.importorskip("airflow.sdk", reason="needs Airflow 3: pip install -e '.[airflow]'")
import pendulum  # noqa: E402  (Airflow's dependency)

EXAMPLE = Path(__file__).parent.parent / "jobs" / "nightly_dag.py"
DATE = pendulum.datetime(2026, 11, 30, tz="UTC")
INPUT_IDS = [f"r{i:05d}" for i in range(34)]


@pytest.fixture(scope="module", autouse=True)
def airflow_db():
    from airflow.utils.db import initdb

    initdb()


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model):
    """A job on the tiny model, and the example DAGs pointed at it (two shards) through their environment."""
    root = tmp_path_factory.mktemp("nightly")
    write_rows(root / "in" / "a.parquet", 24, row_group_size=8)
    write_rows(root / "in" / "b.parquet", 9, start=24)
    pq.write_table(pa.table({"id": ["r00033"], "text": [""], "source": ["test"]}), root / "in" / "c.parquet")
    job = write_job(root, tiny_model, root / "in", batch_size=4, max_tokens=64)
    # One engine per run: the fallback pass has its own tests. The empty row is always rejected (empty_prompt).
    job.write_text(job.read_text().replace("[fallback]\n", "[fallback]\nenabled = false\n"))
    # The same spec (the output section is not part of its hash), with no rejects allowed.
    (root / "strict.toml").write_text(job.read_text().replace("max_reject_rate = 1.0", "max_reject_rate = 0.0"))
    os.environ.update(BATCHJSON_DAG_JOB=str(job), BATCHJSON_DAG_OUTPUT=str(root / "out"), BATCHJSON_DAG_SHARDS="2")
    shutil.copy(EXAMPLE, DAGS)
    yield root
    for var in ("BATCHJSON_DAG_JOB", "BATCHJSON_DAG_OUTPUT", "BATCHJSON_DAG_SHARDS"):
        os.environ.pop(var)


@pytest.fixture
def shared_engines(engines, monkeypatch):
    """The operator's runs decode on the session's real engines (conftest.py): the runs of this module's job share
    one engine start, where each run (each mapped shard too) would start its own, ~25 s apiece on two cores."""
    from batchjson import job as runs

    real = runs.run_job
    monkeypatch.setattr(runs, "run_job", lambda spec, output=None, **kwargs: real(
        spec, output, engine_factory=engines, **kwargs))


def load_dags(path: Path):
    """The DAGs of one file, parsed as the DAG processor parses them."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(path))
    assert not bag.import_errors, bag.import_errors
    return bag.dags


def one_task_dag(dag_id: str, **operator_args):
    """A DAG file in the dags folder with one BatchJsonOperator task, `extract`."""
    args = ", ".join(f"{k}={v!r}" for k, v in operator_args.items())
    path = DAGS / f"{dag_id}.py"
    path.write_text(f"""import pendulum
from airflow.sdk import DAG
from batchjson.airflow import BatchJsonOperator

with DAG({dag_id!r}, schedule=None, start_date=pendulum.datetime(2026, 11, 1, tz="UTC")) as dag:
    BatchJsonOperator(task_id="extract", {args})
""")
    return load_dags(path)[dag_id]


def run(dag) -> dict:
    """dag.test() for DATE; the task instances by (task_id, map_index)."""
    dag_run = dag.test(logical_date=DATE)
    return {(ti.task_id, ti.map_index): ti for ti in dag_run.get_task_instances()}


def report_of(ti, key="return_value") -> dict:
    return ti.xcom_pull(task_ids=ti.task_id, map_indexes=ti.map_index, key=key)


def partition_ids(dataset: Path) -> list[tuple[str, str]]:
    """(id, dt) of every valid and rejected row, read as one hive-partitioned dataset."""
    return duckdb.sql(f"""
        select id, cast(dt as varchar) from read_parquet('{dataset}/dt=*/*.parquet', hive_partitioning = true)
        union all
        select id, regexp_extract(filename, 'dt=([^/]+)', 1)
        from read_parquet('{dataset}/dt=*/_rejects/*.parquet', filename = true)""").fetchall()


def test_example_dags_parse():
    dags = load_dags(EXAMPLE)
    assert set(dags) == {"batchjson_nightly", "batchjson_nightly_sharded", "batchjson_nightly_bash"}
    assert dags["batchjson_nightly"].get_task("extract").output_dir.endswith("/invoices/dt={{ ds }}")


def test_a_problem_to_fix_fails_the_task_with_its_message(tmp_path, capfd):
    tis = run(one_task_dag("bad_input", job=str(tmp_path / "missing.toml"), output_dir=str(tmp_path / "out")))
    assert tis["extract", -1].state == "failed"
    assert "missing.toml cannot be read" in "".join(capfd.readouterr())


@pytest.mark.engine
def test_nightly_dag_writes_each_row_once_and_reruns_idempotently(env, shared_engines, capfd):
    dag = load_dags(DAGS / EXAMPLE.name)["batchjson_nightly"]
    first = run(dag)["extract", -1]
    assert first.state == "success"
    report = report_of(first)
    assert report["input_rows"] == 34 and report["valid"] + report["rejected"] == 34 and not report["resumed"]
    rows = partition_ids(env / "out" / "invoices")
    assert sorted(rows) == [(i, "2026-11-30") for i in INPUT_IDS]
    # pyarrow reads the same dataset; it skips _rejects and _batchjson as DuckDB's dt=*/*.parquet glob does.
    table = ds.dataset(env / "out" / "invoices", format="parquet", partitioning="hive").to_table(columns=["id", "dt"])
    assert len(table) == report["valid"] and set(table.column("dt").to_pylist()) == {"2026-11-30"}

    again = run(dag)["extract", -1]
    assert again.state == "success" and report_of(again)["resumed"] and report_of(again)["passes"] == {}
    assert partition_ids(env / "out" / "invoices") == rows

    # Over the threshold: the task fails, and the report is in XCom all the same. (Resumes: no engine starts.)
    strict = run(one_task_dag("strict", job=str(env / "strict.toml"), output_dir=str(env / "out/invoices/dt={{ ds }}")))
    assert strict["extract", -1].state == "failed"
    assert "rejects 2.9% exceed output.max_reject_rate (0.0%)" in "".join(capfd.readouterr())
    assert report_of(strict["extract", -1], "report")["rejects_by_reason"]["empty_prompt"] == 1


@pytest.mark.engine
def test_replace_rebuilds_the_partition_and_swaps_it_in(env, shared_engines):
    partition = env / "out" / "invoices" / "dt=2026-11-30"
    if not partition.exists():
        run(load_dags(DAGS / EXAMPLE.name)["batchjson_nightly"])
    before = sorted(partition_ids(env / "out" / "invoices"))
    inode = partition.stat().st_ino
    ti = run(one_task_dag("replace", job=os.environ["BATCHJSON_DAG_JOB"],
                          output_dir=str(env / "out/invoices/dt={{ ds }}"), replace=True))["extract", -1]
    assert ti.state == "success"
    report = report_of(ti)
    assert report["output"] == str(partition) and report["passes"]["pass1"]["rows"] == 34  # all done again
    assert partition.stat().st_ino != inode  # a new folder, renamed into place
    assert sorted(partition_ids(env / "out" / "invoices")) == before
    assert [p.name for p in partition.parent.iterdir()] == ["dt=2026-11-30"]  # no temporary folder left


@pytest.mark.engine
def test_mapped_shards_write_exactly_the_rows_of_one_run(env, shared_engines):
    tis = run(load_dags(DAGS / EXAMPLE.name)["batchjson_nightly_sharded"])
    assert {k: ti.state for k, ti in tis.items()} == {("extract", 0): "success", ("extract", 1): "success",
                                                      ("check", -1): "success"}
    rows = [report_of(tis["extract", i])["passes"]["pass1"]["rows"] for i in (0, 1)]
    assert min(rows) > 0 and sum(rows) == 34
    check = report_of(tis["check", -1])
    assert check["passes"] == {} and check["valid"] + check["rejected"] == 34
    assert sorted(partition_ids(env / "out" / "invoices_sharded")) == [(i, "2026-11-30") for i in INPUT_IDS]


@pytest.fixture
def fake_engine(monkeypatch):
    """The operator's runs decode with the fake engine (batchjson/engine/fake.py); all else is batchjson's own."""
    from batchjson import job as runs

    real = runs.run_job
    monkeypatch.setattr(runs, "run_job", lambda spec, output=None, **kwargs: real(
        spec, output, engine_factory=FakeEngines(), progress=False, **kwargs))
    return real


@pytest.mark.parametrize("store", ["local", "s3"])
def test_replace_swaps_the_new_partition_in_on_any_store(tmp_path, tiny_model, fake_engine, monkeypatch, request,
                                                          store):
    from batchjson.cli import main
    from batchjson.spec import load_spec

    monkeypatch.chdir(tmp_path)  # where a URI taken for a local path would land
    write_rows(tmp_path / "night1" / "a.parquet", 8)
    write_rows(tmp_path / "night2" / "a.parquet", 4, start=100)
    job = write_job(tmp_path, tiny_model, tmp_path / "night1", batch_size=4)
    root, options = str(tmp_path / "invoices"), ""
    if store == "s3":
        root, options = f"{request.getfixturevalue('s3')}/invoices", "?endpoint_override={}&scheme=http".format(
            request.getfixturevalue("s3_server").endpoint)
        monkeypatch.delenv("AWS_ENDPOINT_URL")  # only the URI's options lead to the server: the swap keeps them
    partition = f"{root}/dt=2026-11-30"
    fake_engine(load_spec(job), partition + options, engine_factory=FakeEngines(), progress=False)  # last night's

    ti = run(one_task_dag(f"replace_{store}", job=str(job), input_path=str(tmp_path / "night2"),
                          output_dir=f"{root}/dt={{{{ ds }}}}{options}", replace=True))["extract", -1]
    assert ti.state == "success"
    report = report_of(ti)
    assert report["output"] == partition and report["passes"]["pass1"]["rows"] == 4

    def ids(folder: str) -> list[str]:  # as pyarrow.dataset reads the folder (none: no rejects, on S3)
        filesystem, path = fs.FileSystem.from_uri(folder + options)
        if filesystem.get_file_info(path).type == fs.FileType.NotFound:
            return []
        dataset = ds.dataset(path, filesystem=filesystem, format="parquet")
        return dataset.to_table(columns=["id"])["id"].to_pylist() if dataset.files else []

    assert len(ids(partition)) == report["valid"]
    assert sorted(ids(partition) + ids(f"{partition}/_rejects")) == [f"r{i:05d}" for i in range(100, 104)]
    verify = CliRunner().invoke(main, ["verify", str(job), "--input", str(tmp_path / "night2"),
                                       "--output", partition + options])
    assert verify.exit_code == 0 and f"{report['valid']} output + {report['rejected']} rejected" in verify.output
    filesystem, path = fs.FileSystem.from_uri(root + options)
    # No file of the new partition's sibling is left (SeaweedFS may keep an empty folder entry, which holds none).
    files = filesystem.get_file_info(fs.FileSelector(path, recursive=True))
    assert {i.path[len(path) + 1:].split("/")[0] for i in files if i.type == fs.FileType.File} == {"dt=2026-11-30"}
    assert not (tmp_path / "s3:").exists()
