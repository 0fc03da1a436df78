"""The benchmark's engine scenarios, each run in its own subprocess by throughput.py: bare vLLM, batchjson, a sweep.

Every scenario takes the same scenario dict (see common.build_spec), so both sides of a comparison get the same
rows, prompts, constraint, speculation and engine keyword arguments; the batchjson side records the kwargs it
really passed to vllm.LLM, and throughput.py checks they equal the bare side's.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

from batchjson.records import Stage
from bench.common import P1, P2, Clock, RssMonitor, build_spec, frame, rate, spec_prompts

SPEC_METRICS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}


def _env() -> None:
    # The same defaults batchjson.engine.vllm_engine._vllm() sets, before vLLM is imported, so both sides start alike.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def engine_kwargs(spec, decoding, speculative) -> dict:
    """vllm.LLM kwargs for one pass, written out independently of batchjson.engine (the baseline must not
    inherit a batchjson bug); the batchjson worker reports what VllmEngine passed, and bench.py compares."""
    from vllm.platforms import current_platform

    from batchjson.engine import resolve_model
    from batchjson.schema.grammar import choose

    # The backend batchjson decodes with ("auto" is batchjson's choice; vLLM refuses its own "auto" with whitespace off).
    backend = choose(spec.schema_doc, decoding.structured_output_backend or spec.model.structured_output_backend,
                     spec.model.disable_any_whitespace).backend
    kw = dict(model=resolve_model(spec.model.path), dtype=spec.model.dtype, disable_log_stats=False,
              structured_outputs_config={"backend": backend, "disable_any_whitespace": spec.model.disable_any_whitespace})
    if spec.model.max_model_len:
        kw["max_model_len"] = spec.model.max_model_len
    if current_platform.is_cpu():
        kw["enforce_eager"] = True
        if decoding.seed is not None:
            kw["seed"] = decoding.seed
    if speculative is not None:
        sc = {"method": speculative.method, "num_speculative_tokens": speculative.num_speculative_tokens,
              "draft_sample_method": speculative.draft_sample_method}
        if speculative.method == "ngram":
            sc |= {"prompt_lookup_min": speculative.prompt_lookup_min, "prompt_lookup_max": speculative.prompt_lookup_max}
        if speculative.draft_model:
            sc["model"] = resolve_model(speculative.draft_model)
        kw["speculative_config"] = sc | speculative.options
    kw.update(spec.model.engine)
    return kw


def spec_counters(llm) -> dict:
    out = dict.fromkeys(SPEC_METRICS.values(), 0.0)
    for metric in llm.get_metrics():
        if metric.name in SPEC_METRICS and hasattr(metric, "value"):
            out[SPEC_METRICS[metric.name]] += metric.value
    return out


def acceptance(before: dict, after: dict) -> float | None:
    drafted = after["draft_tokens"] - before["draft_tokens"]
    return round((after["accepted_tokens"] - before["accepted_tokens"]) / drafted, 3) if drafted else None


class StepTimer:
    """Counts llm_engine.step() calls and the time the front end spends blocked in them.

    Time inside step() is the front end waiting on (or draining) the engine; the rest of a window is the
    caller's own work: rendering, validation, writing. In vLLM V1 the engine core runs in its own process, so
    the caller's work only costs throughput when it delays refilling the engine.
    """

    def __init__(self, llm_engine):
        self.steps, self.in_step = 0, 0.0
        inner = llm_engine.step

        def step():
            t = time.perf_counter()
            try:
                return inner()
            finally:
                self.in_step += time.perf_counter() - t
                self.steps += 1

        llm_engine.step = step  # an instance attribute: LLM._run_engine and VllmEngine.stream both call it


def _speculative(spec):
    return spec.speculative if spec.speculative.enabled else None


def _params_summary(p) -> dict:
    so = p.structured_outputs
    return {"temperature": p.temperature, "top_p": p.top_p, "max_tokens": p.max_tokens,
            "repetition_penalty": p.repetition_penalty, "seed": p.seed,
            "json": bool(so and (so.json is not None)), "json_object": bool(so and so.json_object),
            "repetition_detection": repr(getattr(p, "repetition_detection", None))}


def _repetition(settings: dict | None) -> dict:
    if not settings:
        return {}
    from vllm.sampling_params import RepetitionDetectionParams

    return {"repetition_detection": RepetitionDetectionParams(**settings)}


def bare(sc: dict) -> dict:
    """(a) Bare vLLM: one llm.generate over all prompts, same constraint and speculation, validated afterwards."""
    _env()
    import vllm
    from vllm.sampling_params import StructuredOutputsParams

    from batchjson.records import Generation
    from batchjson.schema.validate import Validator

    spec = build_spec(sc)
    mon = RssMonitor()
    mon.start()
    kwargs = engine_kwargs(spec, spec.sampling, _speculative(spec))
    with Clock() as start:
        llm = vllm.LLM(**kwargs)
    d = spec.sampling
    seed = None if "seed" in kwargs else d.seed
    params = vllm.SamplingParams(temperature=d.temperature, top_p=d.top_p, max_tokens=d.max_tokens,
                                 repetition_penalty=d.repetition_penalty, frequency_penalty=d.frequency_penalty,
                                 presence_penalty=d.presence_penalty, seed=seed,
                                 structured_outputs=StructuredOutputsParams(json=spec.schema_doc),
                                 **_repetition(getattr(d, "repetition_detection", None)))
    timer = StepTimer(llm.llm_engine)
    with Clock() as render:
        prompts = spec_prompts(spec, frame(llm, spec.prompt.system))  # the chat frame batchjson renders
    before = spec_counters(llm)
    with Clock() as gen:
        outs = llm.generate([p.text for p in prompts], params, use_tqdm=False)
    after = spec_counters(llm)
    validator = Validator(spec.schema_doc)
    with Clock() as check:
        valid = tokens = 0
        reasons: dict[str, int] = {}
        for p, out in zip(prompts, outs):
            c = out.outputs[0]
            g = Generation(p, c.text, c.finish_reason or "", len(out.prompt_token_ids or ()), len(c.token_ids))
            if g.finish_reason in ("abort", "error"):
                g.error = "engine_error"
            o = validator.check(g)
            valid += o.ok
            tokens += g.output_tokens
            if o.reason:
                reasons[o.reason] = reasons.get(o.reason, 0) + 1
    with Clock() as close:
        llm.llm_engine.engine_core.shutdown()
    seconds = render.wall + gen.wall + check.wall
    return {"side": "bare", "rows": len(prompts), "valid": valid, "output_tokens": tokens, "reasons": reasons,
            "seconds": round(seconds, 3), "generate_s": round(gen.wall, 3), "render_s": round(render.wall, 4),
            "validate_s": round(check.wall, 4), "engine_start_s": round(start.wall, 2), "close_s": round(close.wall, 2),
            "end_to_end_s": round(start.wall + seconds + close.wall, 2),
            "rows_per_s": rate(len(prompts), seconds), "output_tokens_per_s": rate(tokens, seconds),
            "valid_per_s": rate(valid, seconds), "valid_per_s_end_to_end": rate(valid, start.wall + seconds + close.wall),
            "acceptance": acceptance(before, after), "spec": {k: after[k] - before[k] for k in after},
            "steps": timer.steps, "in_step_s": round(timer.in_step, 3), "front_end_cpu_s": round(gen.cpu, 2),
            "llm_kwargs": kwargs, "params": _params_summary(params), **mon.stop()}


class _TimedEngine:
    """Wraps an engine batchjson starts: times its start, its stream window and its close; counts steps.

    A pass may start more than one engine (after an engine death); the times of a pass add up in `rec`.
    """

    def __init__(self, engine, start_s: float, rec: dict):
        self.engine, self.rec = engine, rec
        rec["engine_starts"] = rec.get("engine_starts", 0) + 1
        rec["engine_start_s"] = round(rec.get("engine_start_s", 0) + start_s, 2)
        self.timer = StepTimer(engine.llm.llm_engine)
        rec["params"] = _params_summary(engine.params[Stage.FIRST])

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def stream(self, *args, **kwargs):
        c = Clock().__enter__()
        try:
            yield from self.engine.stream(*args, **kwargs)
        finally:
            c.__exit__()
            r = self.rec
            r["stream_s"] = round(r.get("stream_s", 0) + c.wall, 3)
            r["front_end_cpu_s"] = round(r.get("front_end_cpu_s", 0) + c.cpu, 2)
            r["steps"] = r.get("steps", 0) + self.timer.steps
            r["in_step_s"] = round(r.get("in_step_s", 0) + self.timer.in_step, 3)

    def stats(self):
        return self.engine.stats()

    def close(self):
        with Clock() as c:
            self.engine.close()
        self.rec["close_s"] = round(self.rec.get("close_s", 0) + c.wall, 2)


def batchjson_side(sc: dict) -> dict:
    """(b) batchjson's run on the same rows: both passes, with what each pass's engine was started with."""
    _env()
    import vllm

    from batchjson.engine import VllmEngines
    from batchjson.job import run_job

    seen_kwargs: list[dict] = []
    real_init = vllm.LLM.__init__

    def spy(self, *args, **kwargs):  # record what VllmEngine really passes, to prove the settings are the same
        seen_kwargs.append(dict(kwargs))
        return real_init(self, *args, **kwargs)

    vllm.LLM.__init__ = spy
    spec = build_spec(sc)
    recs: dict[str, dict] = {P1: {}, P2: {}}

    class Timed(VllmEngines):
        def start(self, spec_, decoding, speculative):
            with Clock() as c:
                engine = super().start(spec_, decoding, speculative)
            return _TimedEngine(engine, c.wall, recs[P1])  # pass 2 decodes on pass 1's engine, beside it

    factory = Timed()

    mon = RssMonitor()
    mon.start()
    with Clock() as total:
        report = run_job(spec, sc["output"], engine_factory=factory, progress=False, fresh=True).to_dict()
    res = {"side": "batchjson", "rows": report["input_rows"], "valid": report["valid"], "rejected": report["rejected"],
           "rescued_by_fallback": report["rescued_by_fallback"], "end_to_end_s": round(total.wall, 2),
           "passes": {}, "llm_kwargs": seen_kwargs[0] if seen_kwargs else None,
           "llm_kwargs_pass2": seen_kwargs[1] if len(seen_kwargs) > 1 else None, **mon.stop()}
    for name, p in report["passes"].items():
        res["passes"][name] = {**{k: p[k] for k in ("rows", "valid", "output_tokens", "seconds", "reasons")},
                               "acceptance": p.get("acceptance"), "spec": p.get("speculative"), "note": p.get("note"),
                               **recs.get(name, {})}
    p1 = res["passes"].get(P1, {})
    windows = sum(p.get("stream_s", 0) for p in res["passes"].values())
    tokens = sum(p["output_tokens"] for p in res["passes"].values())
    res |= {"seconds": round(p1.get("stream_s", 0), 3), "output_tokens": p1.get("output_tokens", 0),
            "rows_per_s": rate(p1.get("rows", 0), p1.get("stream_s", 0)),
            "output_tokens_per_s": rate(p1.get("output_tokens", 0), p1.get("stream_s", 0)),
            "pass1_valid": p1.get("valid", 0), "acceptance": p1.get("acceptance"),
            "both_passes_s": round(windows, 3), "both_passes_output_tokens_per_s": rate(tokens, windows),
            "valid_per_s": rate(res["valid"], windows), "valid_per_s_end_to_end": rate(res["valid"], total.wall),
            "pass1_valid_per_s": rate(p1.get("valid", 0), p1.get("stream_s", 0))}
    return res


def sweep(sc: dict) -> dict:
    """One engine (one speculation method), then every in-flight size in turn on disjoint slices of the rows.

    The in-flight size is batchjson's max_in_flight: VllmEngine.stream keeps that many requests in the engine.
    """
    _env()
    method = sc.get("method", "none")
    if method == "suffix" and importlib.util.find_spec("arctic_inference") is None:
        return {"method": method, "skipped": "arctic-inference is not importable here (suffix decoding needs it)"}
    from batchjson.engine import VllmEngine, resolve_model
    from batchjson.prompts import chat_frame
    from batchjson.schema.validate import Validator

    spec = build_spec(sc)
    mon = RssMonitor()
    mon.start()
    with Clock() as start:
        engine = VllmEngine(spec.model, spec.sampling, spec.schema_doc, _speculative(spec))
    timer = StepTimer(engine.llm.llm_engine)
    prompts = spec_prompts(spec, chat_frame(resolve_model(spec.model.path), spec.prompt.system))
    validator = Validator(spec.schema_doc)
    warm = int(sc.get("warmup", 2))
    engine.max_in_flight = max(warm, 1)
    list(engine.stream(prompts[:warm]))  # first requests compile the schema's grammar: keep that out of the numbers
    at, points = warm, []
    for n in sc["in_flight"]:
        count = max(int(sc.get("min_rows", 4)), int(sc.get("waves", 2)) * n)
        rows = prompts[at:at + count]
        at += count
        engine.max_in_flight = n
        before, steps0, busy0 = engine.stats(), timer.steps, timer.in_step
        with Clock() as c:
            gens = list(engine.stream(rows))
        after = engine.stats()
        outcomes = [validator.check(g) for g in gens]
        tokens = sum(g.output_tokens for g in gens)
        steps = timer.steps - steps0
        points.append({"method": method, "in_flight": n, "rows": len(gens), "seconds": round(c.wall, 3),
                       "rows_per_s": rate(len(gens), c.wall), "output_tokens_per_s": rate(tokens, c.wall),
                       "valid": sum(o.ok for o in outcomes), "valid_per_s": rate(sum(o.ok for o in outcomes), c.wall),
                       "acceptance": acceptance(before, after), "steps": steps,
                       "drafts": after.get("drafts", 0) - before.get("drafts", 0),
                       "ms_per_step": round(1000 * c.wall / steps, 3) if steps else None,
                       "tokens_per_step": round(tokens / steps, 2) if steps else None,
                       "in_step_s": round(timer.in_step - busy0, 3), "truncated": sum(o.reason == "truncated" for o in outcomes)})
        if len(rows) < count:
            points[-1]["note"] = f"only {len(rows)} rows were left for {count}"
    engine.close()
    return {"method": method, "engine_start_s": round(start.wall, 2), "points": points, **mon.stop()}


WORKERS = {"bare": bare, "batchjson": batchjson_side, "sweep": sweep}


def main(kind: str, scenario: Path, result: Path) -> int:
    import json
    import traceback

    from bench.common import dump

    sc = json.loads(scenario.read_text())
    try:
        if kind == "overhead":
            from bench.overhead import run_overhead

            out = run_overhead(sc)
        else:
            out = WORKERS[kind](sc)
        dump(result, out)
        return 0
    except BaseException as e:  # the parent reads the result file; a traceback there says what broke
        dump(result, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]})
        traceback.print_exc()
        return 1
