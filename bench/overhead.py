"""batchjson's own cost per row, outside the engine: run_job against an in-process fake engine (no vLLM).

The engine is batchjson's fake one (batchjson/engine/fake.py): it keeps max_in_flight prompts buffered as the real
engine does, and answers with canned outputs: a fixed share of pass-1 rows fail (loops, schema errors and
truncations, as SmolLM2 does on the sample task) so pass 2's re-queue paths run too.
"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import resource
import time

from batchjson.engine import EngineFactory, EngineWrapper
from batchjson.engine.fake import Answer, FakeEngine
from bench.common import MB, P2, Clock, build_spec

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
# The failures the fake cycles over: "repetition" (vLLM stopped a looping row: what SmolLM2's pass-1 failures were on
# the H200, 11% of rows), "length" (truncated) and "schema" (valid JSON, wrong values).
FAILURES = {"repetition": Answer(TRUNCATED, "repetition", 43), "length": Answer(TRUNCATED, "length", 320),
            "schema": Answer(SCHEMA_BAD, "stop", 40)}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def chat_frame(system: str) -> tuple[str, str]:
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"


def fake_engine(max_in_flight: int, fail_rate: float, kinds: tuple[str, ...]) -> FakeEngine:
    """batchjson's fake engine with the sample task's answers: a fixed share of them failing, `kinds` in turn."""
    return FakeEngine(1 - fail_rate, max_in_flight=max_in_flight, cycle=True, prompt_tokens=300,
                      answers=[Answer(v, "stop", 90) for v in VALID], failures=[FAILURES[k] for k in kinds])


class SampledEngine(EngineWrapper):
    """The fake engine, with the runner's RSS sampled every `every` answers and at the end of each stream."""

    def __init__(self, inner: FakeEngine, log: list, tag: str, every: int = 10_000):
        super().__init__(inner)
        self.log, self.tag, self.every = log, tag, every

    def stream(self, prompts, stop=None):
        for gen in self.inner.stream(prompts, stop):
            if self.inner.answered % self.every == 0:
                self.log.append((self.tag, self.inner.answered, _rss()))
            yield gen
        self.log.append((f"{self.tag}-end", self.inner.answered, _rss()))


# Stages of the run, as (file suffix, function): disjoint, so their cumulative times add up.
STAGES = {
    "read input (ParquetSource.unit)": [("batchjson/source.py", "unit")],
    "render prompts (Renderer.render)": [("batchjson/prompts.py", "render")],
    "validate (Validator.check)": [("batchjson/schema/validate.py", "check"), ("bench/overhead.py", "check")],
    "build Arrow tables (PartSink.valid/rejected)": [("batchjson/tables.py", "valid"),
                                                     ("batchjson/tables.py", "rejected")],
    "write Parquet parts (commits.write_part)": [("batchjson/storage/commits.py", "write_part")],
    "commit records (Commits.begin/publish/done, write_json)": [
        ("batchjson/storage/commits.py", "begin"), ("batchjson/storage/commits.py", "publish"),
        ("batchjson/storage/commits.py", "done"),
        ("batchjson/storage/location.py", "write_json")],
    "pass-2 re-read (Worker._requeued)": [("batchjson/worker.py", "_requeued")],
    "exactly-once check (verify.verify)": [("batchjson/verify.py", "verify")],
    "report tally (RunReport.tally)": [("batchjson/report.py", "tally")],
    "source.check (footers)": [("batchjson/source.py", "check")],
    "load the tokenizer (prompts.chat_frame)": [("batchjson/prompts.py", "chat_frame")],
    "progress bar (tqdm.update)": [("tqdm/std.py", "update")],
    "fake engine (own time)": [("batchjson/engine/fake.py", "stream"), ("batchjson/engine/fake.py", "answer"),
                               ("bench/overhead.py", "stream")],
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
    fake = SampledEngine(fake_engine(max_in_flight, fail_rate, kinds), [], "cost")
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
    from batchjson.schema.validate import Validator
    from batchjson.source import ParquetSource
    from batchjson.storage import Location
    from batchjson.storage.commits import write_part
    from batchjson.tables import PartSink

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
    renderer = Renderer(spec.prompt, chat_frame(spec.prompt.system),
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
        target = Location.of(Path(d) / "p.parquet")
        out["write_part_us_per_unit"] = _per_call(lambda: write_part(table, target), 200)
        names = iter(range(10**9))  # a new file each time: creating a marker is what the ledger does per unit
        out["create_marker_us"] = _per_call(lambda: (Path(d) / f"m{next(names)}").touch(), 2000)
    out["rows_per_unit"] = n
    return out


def what_if(changes: list[str]) -> None:
    """Patch batchjson in this worker process only, to measure a proposed runner change before anyone makes it.

    rs_validator: decide validity with jsonschema-rs (compiled, Rust); keep jsonschema only to explain failures.
    """
    if "rs_validator" in changes:
        import jsonschema_rs
        import orjson

        from batchjson.records import Outcome
        from batchjson.schema.validate import Validator

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


def run_overhead(sc: dict) -> dict:
    from batchjson.job import run_job

    spec = build_spec(sc)
    what_if(sc.get("what_if", []))
    fail_rate, log = float(sc.get("fail_rate", 0.11)), []
    kinds = tuple(sc.get("fail_kinds", ["repetition"]))

    class Engines(EngineFactory):
        drafts_optional = True  # the fake engine decodes a request without a draft: auto need not ask vLLM (an import)

        def start(self, spec_, decoding, speculative):  # both passes share it, and its fail rate
            return SampledEngine(fake_engine(spec_.model.max_in_flight, fail_rate, kinds), log, "engine")

    factory = Engines()

    # Where the end of a run spends memory: RSS around the report's tally (over the commit records).
    from batchjson.report import RunReport

    real_tally, tally = RunReport.tally, {}

    def timed_tally(self, *args):
        tally["rss_before_mb"] = round(_rss() / MB, 1)
        tally["peak_before_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        with Clock() as c:
            real_tally(self, *args)
        tally.update(rss_after_mb=round(_rss() / MB, 1), wall_s=round(c.wall, 3), cpu_s=round(c.cpu, 3),
                     peak_after_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))

    RunReport.tally = timed_tally
    # The run loads the model's tokenizer for its chat frame; importing transformers for that (seconds, once per
    # process) is not a cost per row, so it happens here, before the clock.
    from batchjson.engine import resolve_model
    from batchjson.prompts import chat_frame as load_chat_frame

    load_chat_frame(resolve_model(spec.model.path), spec.prompt.system)
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
           "valid": report.valid, "rejected": report.rejected, "pass2_rows": report.passes.get(P2).rows
           if P2 in report.passes else 0, "wall_s": round(c.wall, 3), "cpu_s": round(c.cpu, 3),
           "fake_engine_us_per_call": round(1e6 * fake, 3),
           "us_per_row_cpu": round(1e6 * (c.cpu - fake * engine_rows) / rows, 2),
           "us_per_row_wall": round(1e6 * (c.wall - fake * engine_rows) / rows, 2),
           "rss_start_mb": round(rss0 / MB, 1), "rss_end_mb": round(_rss() / MB, 1),
           "runner_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
           "rss_by_rows_mb": [(tag, n, round(r / MB, 1)) for tag, n, r in log], "tally": tally}
    if prof:
        res |= _breakdown(prof, rows) | {"micro": micro(spec)}
    return res
