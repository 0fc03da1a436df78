"""batchjson's own cost per row, outside the engine: run_job against an in-process fake engine (no vLLM).

The fake implements batchjson.engine.Engine (stream, stats, close), keeps max_in_flight prompts
buffered as the real engine does, and answers with canned outputs: a share of pass-1 rows fail (schema errors
and truncations, as SmolLM2 does on the sample task) so pass 2's re-queue paths run too.
"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import resource
import time
from collections import deque

from common import MB, Clock, build_spec

VALID = [
    '{"vendor":"PixelPro Devices","currency":"USD","category":"hardware","total":16160.27,"items":[{"description":'
    '"laptop","quantity":8,"unit_price":1737.6},{"description":"external SSD 1TB","quantity":10,"unit_price":104.78},'
    '{"description":"USB-C docking station","quantity":9,"unit_price":134.63}]}',
    '{"vendor":"Staple & Co","currency":"EUR","category":"office","total":87.5,"items":[{"description":'
    '"box of ballpoint pens","quantity":5,"unit_price":17.5}]}',
    '{"vendor":"SkyBridge Travel Agency","currency":"GBP","category":"travel","total":1210.0,"items":[{"description":'
    '"hotel room night","quantity":4,"unit_price":240.0},{"description":"airport taxi ride","quantity":2,"unit_price":125.0}]}',
]
SCHEMA_BAD = '{"vendor":"Staple & Co","currency":"JPY","category":"office","total":87.5,"items":[]}'
TRUNCATED = '{"vendor":"Datavault SaaS","currency":"USD","category":"software","total":12.0,"items":[{"description":"API'


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class FakeEngine:
    """An Engine that costs next to nothing: canned outputs, a share of them failing, RSS sampled as it goes.

    `fail_kinds` cycles over the failures: "repetition" (vLLM stopped a looping row: what SmolLM2's pass-1
    failures were on the H200, 11% of rows), "length" (truncated) and "schema" (valid JSON, wrong values).
    """

    def __init__(self, max_in_flight: int, fail_rate: float, rss_every: int = 10_000, log: list | None = None,
                 tag: str = "pass1", fail_kinds: tuple[str, ...] = ("repetition",)):
        self.max_in_flight, self.fail_per_100, self.rss_every = max_in_flight, round(fail_rate * 100), rss_every
        self.log, self.tag, self.fail_kinds = (log if log is not None else []), tag, fail_kinds
        self.n = 0

    @staticmethod
    def chat_frame(system: str) -> tuple[str, str]:
        return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"

    def _answer(self, prompt):
        from batchjson.records import Generation

        self.n += 1
        if self.n % self.rss_every == 0:
            self.log.append((self.tag, self.n, _rss()))
        slot = self.n % 100
        if slot < self.fail_per_100:
            kind = self.fail_kinds[slot % len(self.fail_kinds)]
            if kind == "length":
                return Generation(prompt, TRUNCATED, "length", 300, 320)
            if kind == "repetition":
                return Generation(prompt, TRUNCATED, "repetition", 300, 43)
            return Generation(prompt, SCHEMA_BAD, "stop", 300, 40)
        return Generation(prompt, VALID[self.n % 3], "stop", 300, 90)

    def stream(self, prompts, stop=None):
        window = deque()
        for p in prompts:
            if stop is not None and stop.is_set():
                return
            window.append(p)
            if len(window) >= self.max_in_flight:
                yield self._answer(window.popleft())
        while window:
            yield self._answer(window.popleft())
        self.log.append((f"{self.tag}-end", self.n, _rss()))

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


# Stages of the run, as (file suffix, function): disjoint, so their cumulative times add up.
STAGES = {
    "read input (ParquetSource.units)": [("batchjson/source.py", "units")],
    "render prompts (Renderer.render)": [("batchjson/prompts.py", "render")],
    "validate (Validator.check)": [("batchjson/validate.py", "check"), ("bench/overhead.py", "check")],
    "build Arrow tables (PartSink.valid/rejected)": [("batchjson/sink.py", "valid"), ("batchjson/sink.py", "rejected")],
    "write Parquet parts (Storage._write)": [("batchjson/storage.py", "_write")],
    "commit records (Storage.commit/done)": [("batchjson/storage.py", "commit"), ("batchjson/storage.py", "done")],
    "pass-2 re-read (JobRun._requeued)": [("batchjson/run.py", "_requeued")],
    "report tally (re-read all outputs)": [("batchjson/report.py", "tally")],
    "source.check (footers)": [("batchjson/source.py", "check")],
    "progress bar (tqdm.update)": [("tqdm/std.py", "update")],
    "fake engine (own time)": [("bench/overhead.py", "stream"), ("bench/overhead.py", "_answer")],
}


def _breakdown(prof: cProfile.Profile, rows: int) -> dict:
    st = pstats.Stats(prof)
    total = max(ct for (_, _, fn), (_, _, _, ct, _) in st.stats.items() if fn == "run_job")
    out, used = {}, 0.0
    for stage, keys in STAGES.items():
        t = 0.0
        for (file, _, fn), (_, _, tt, ct, _) in st.stats.items():
            if any(file.endswith(f) and fn == k for f, k in keys):
                t += tt if stage.startswith("fake") else ct
        out[stage] = round(1e6 * t / rows, 2)
        used += t
    out["other (run loop, records, report)"] = round(1e6 * (total - used) / rows, 2)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    top = [ln for ln in buf.getvalue().splitlines() if ln.strip()][-19:]
    return {"profiled_total_us_per_row": round(1e6 * total / rows, 2), "us_per_row_by_stage": out, "top_tottime": top}


def _fake_cost(rows: int, max_in_flight: int, fail_rate: float, kinds: tuple[str, ...]) -> float:
    """Seconds of CPU per row that the fake engine itself spends, to subtract from the run's total."""
    from batchjson.records import Prompt

    prompts = [Prompt(f"r{i}", "u", "text") for i in range(rows)]
    fake = FakeEngine(max_in_flight, fail_rate, fail_kinds=kinds)
    t = time.process_time()
    for _ in fake.stream(iter(prompts)):
        pass
    return (time.process_time() - t) / rows


def _per_call(fn, n: int) -> float:
    t = time.process_time()
    for _ in range(n):
        fn()
    return round(1e6 * (time.process_time() - t) / n, 2)


def micro(spec) -> dict:
    """Direct timings of single steps, without the profiler's inflation (CPU microseconds per call or row)."""
    import tempfile
    from pathlib import Path

    import orjson
    import pyarrow as pa

    from batchjson.prompts import Renderer
    from batchjson.records import Generation, Prompt
    from batchjson.sink import PartSink
    from batchjson.storage import Storage
    from batchjson.source import ParquetSource
    from batchjson.validate import Validator

    v = Validator(spec.schema_doc)
    p = Prompt("inv-1", "u", "text", {"source": "email"})
    good, bad, cut = (Generation(p, t, r, 300, 90) for t, r in ((VALID[0], "stop"), (SCHEMA_BAD, "stop"), (TRUNCATED, "length")))
    out = {"validate_valid_us": _per_call(lambda: v.check(good), 3000),
           "validate_schema_error_us": _per_call(lambda: v.check(bad), 3000),
           "validate_truncated_us": _per_call(lambda: v.check(cut), 3000),
           "orjson_loads_us": _per_call(lambda: orjson.loads(VALID[0]), 20000)}
    if v._validator is not None:  # what a cheaper check would cost: is_valid, errors only walked on failure
        value = orjson.loads(VALID[0])
        out["jsonschema_is_valid_us"] = _per_call(lambda: v._validator.is_valid(value), 3000)
    source = ParquetSource(spec.input, spec.prompt.columns)
    unit = next(source.read(source.plan()[:1]))
    renderer = Renderer(spec.prompt, FakeEngine.chat_frame(spec.prompt.system),
                        spec.input.id_column, spec.input.passthrough)
    n = unit.batch.num_rows
    out["render_us_per_row"] = round(_per_call(lambda: list(renderer.render(unit)), 200) / n, 2)
    sink = PartSink(spec.input.id_column, pa.schema([unit.batch.schema.field(c) for c in spec.input.passthrough]),
                    spec.schema_doc)
    outcomes = [v.check(Generation(Prompt(f"r{i}", "u", "t", {"source": "email"}), VALID[i % 3], "stop", 300, 90))
                for i in range(n)]
    out["build_table_us_per_row"] = round(_per_call(lambda: sink.valid(outcomes, 1), 200) / n, 2)
    table = sink.valid(outcomes, 1)
    with tempfile.TemporaryDirectory() as d:
        target = Path(d) / "p.parquet"
        out["write_part_us_per_unit"] = _per_call(lambda: Storage(Path(d))._write(table, target), 200)
        names = iter(range(10**9))  # a new file each time: creating a marker is what the ledger does per unit
        out["create_marker_us"] = _per_call(lambda: (Path(d) / f"m{next(names)}").touch(), 2000)
    out["rows_per_unit"] = n
    return out


def what_if(changes: list[str]) -> None:
    """Patch batchjson in this worker process only, to measure a proposed runner change before anyone makes it.

    rs_validator: decide validity with jsonschema-rs (compiled, Rust); keep jsonschema only to explain failures.
    lean_tally: count the report's columns one part file at a time instead of one dataset over all files.
    cached_columns: parse the prompt template's placeholders once (PromptSpec.columns is a property that
    re-parses the template for every row Renderer.render formats).
    """
    if "cached_columns" in changes:
        import functools

        from batchjson.spec import PromptSpec

        parse = functools.lru_cache(maxsize=16)(PromptSpec.__dict__["columns"].fget)
        PromptSpec.columns = property(parse)  # frozen dataclasses hash by value: one parse per distinct spec
    if "rs_validator" in changes:
        import jsonschema_rs
        import orjson

        from batchjson.records import Outcome
        from batchjson.validate import Validator

        slow = Validator.check

        def check(self, gen):
            if gen.error or gen.finish_reason in ("repetition", "length") or self.schema is None:
                return slow(self, gen)
            fast = self.__dict__.get("_fast")
            if fast is None:
                fast = self.__dict__["_fast"] = jsonschema_rs.validator_for(self.schema, validate_formats=True)
            try:
                value = orjson.loads(gen.text)
            except orjson.JSONDecodeError:
                return slow(self, gen)
            return Outcome(gen, value=value) if fast.is_valid(value) else slow(self, gen)

        Validator.check = check
    if "lean_tally" in changes:
        from collections import Counter

        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        from batchjson import report

        def count(folder, column):
            out = Counter()
            for f in sorted(folder.glob("*.parquet")):
                for v in pc.value_counts(pq.read_table(f, columns=[column]).column(0)).to_pylist():
                    out[v["values"]] += v["counts"]
            return out

        report._count = count


def run_overhead(sc: dict) -> dict:
    from batchjson.run import run_job

    spec = build_spec(sc)
    what_if(sc.get("what_if", []))
    fail_rate, log = float(sc.get("fail_rate", 0.11)), []
    kinds = tuple(sc.get("fail_kinds", ["repetition"]))

    def factory(spec_, decoding, speculative):
        second = decoding is spec_.fallback
        return FakeEngine(spec_.model.max_in_flight, 0.0 if second else fail_rate, log=log,
                          tag="pass2" if second else "pass1", fail_kinds=kinds)

    # Where the end of a run spends memory: RSS around the report's tally (it re-reads every part file).
    from batchjson.report import RunReport

    real_tally, tally = RunReport.tally, {}

    def timed_tally(self):
        tally["rss_before_mb"] = round(_rss() / MB, 1)
        tally["peak_before_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        with Clock() as c:
            real_tally(self)
        tally.update(rss_after_mb=round(_rss() / MB, 1), wall_s=round(c.wall, 3), cpu_s=round(c.cpu, 3),
                     peak_after_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))

    RunReport.tally = timed_tally
    gc.collect()
    rss0 = _rss()
    prof = cProfile.Profile() if sc.get("profile") else None
    with Clock() as c:
        if prof:
            prof.enable()
        report = run_job(spec, sc["output"], engine_factory=factory, progress=False, fresh=True)
        if prof:
            prof.disable()
    rows = report.input_rows
    engine_rows = sum(p.rows for p in report.passes.values())
    fake = _fake_cost(min(rows, 50_000), spec.model.max_in_flight, fail_rate, kinds)
    res = {"rows": rows, "batch_size": spec.input.batch_size, "fail_rate": fail_rate, "fail_kinds": ",".join(kinds),
           "profiled": bool(prof),
           "what_if": sc.get("what_if", []),
           "valid": report.valid, "rejected": report.rejected, "pass2_rows": report.passes.get("pass2").rows
           if "pass2" in report.passes else 0, "wall_s": round(c.wall, 3), "cpu_s": round(c.cpu, 3),
           "fake_engine_us_per_call": round(1e6 * fake, 3),
           "us_per_row_cpu": round(1e6 * (c.cpu - fake * engine_rows) / rows, 2),
           "us_per_row_wall": round(1e6 * (c.wall - fake * engine_rows) / rows, 2),
           "rss_start_mb": round(rss0 / MB, 1), "rss_end_mb": round(_rss() / MB, 1),
           "runner_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
           "rss_by_rows_mb": [(tag, n, round(r / MB, 1)) for tag, n, r in log], "tally": tally}
    if prof:
        res |= _breakdown(prof, rows) | {"micro": micro(spec)}
    return res
