"""VllmEngine, the one place that talks to vLLM's public API: prompts in, generations out, streamed; VllmEngines,
its factory.

Over 250 lines because it is one adapter: vLLM is imported here only (in `_vllm`, on first use), and a change in
vLLM's API (as guided decoding becoming StructuredOutputsParams) should touch this file alone; split, the class's
start, stream and shutdown would each see part of vLLM. What touches vLLM's internals (the scheduler patches, the
engine-process watcher, the shutdown, an internal abort) is in the wing, engine/vllm/; `engine_kwargs` builds the
engine's arguments without vLLM.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from batchjson.engine import devices, kv_sizes, plugin, reaper
from batchjson.engine.vllm import drafts, fills, kv, patches, processes, scheduler, schema_speculator, versions
from batchjson.engine.base import Engine, EngineFactory, EngineFacts
from batchjson.engine.models import resolve_model
from batchjson.errors import EngineDied, EngineError
from batchjson.schema.grammar import choose
from batchjson.records import WAIT, Generation, Prompt, Stage
from batchjson.spec import DecodingSpec, JobSpec, ModelSpec, SpeculativeSpec

INSTALL_HINT = "pip install 'batchjson[cpu]' (CPU) or 'batchjson[gpu]' (NVIDIA GPU)"


def _vllm():
    """Import vLLM on first use, so `batchjson check` works without it; check it is the V1 offline API we need."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
        from vllm import sampling_params
    except ImportError as e:
        raise EngineError(f"vLLM cannot be imported ({e}). Install it: {INSTALL_HINT}.") from None
    # Drafts run without the grammar only in the V1 engine with StructuredOutputsParams (vLLM >= 0.12): with the
    # V0 guided_decoding API the draft inherited the JSON constraint and the engine died under speculation.
    missing = [name for name, ok in (("StructuredOutputsParams", hasattr(sampling_params, "StructuredOutputsParams")),
                                     ("LLM.enqueue", hasattr(vllm.LLM, "enqueue")),
                                     ("vllm.v1", importlib.util.find_spec("vllm.v1") is not None)) if not ok]
    if missing:
        raise EngineError(f"vLLM {vllm.__version__} lacks {', '.join(missing)}: batchjson needs the V1 engine with "
                          f"structured outputs (vLLM >= 0.12). Upgrade: {INSTALL_HINT}.")
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        # CPU builds refuse to start without a KV cache size, and reserve one of few cores unless told not to. Only
        # here: vLLM hashes its environment variables into the compile cache's key, and on a GPU a variable set for
        # nothing would keep batchjson's engine from the graphs a plain vLLM run of the same model compiled.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        # The CPU worker runs one OpenMP thread per core; by default they spin between parallel regions, taking the
        # cores from vLLM's scheduler, our front end and any other process on the machine. Sleeping threads decode as
        # fast alone and share a small machine instead of collapsing (BENCHMARKS.md, "The sample job on a CPU").
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return vllm



def cpu_dtype(dtype: str, cpuinfo: str = "/proc/cpuinfo") -> str:
    """The dtype a CPU engine decodes in: "auto" (the model's own, bfloat16 for most) only where the processor has
    bfloat16 instructions. Without them oneDNN cannot build its bfloat16 kernels, vLLM falls back to torch's, and
    decoding runs ~4x slower than in float32 (BENCHMARKS.md, "The sample job on a CPU"). An explicit dtype is kept."""
    if dtype != "auto":
        return dtype
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return dtype
    if flags is None:  # not x86 (no "flags" line): vLLM's own choice
        return dtype
    return dtype if {"avx512_bf16", "amx_bf16"} & set(flags) else "float32"


# CUDA graphs for steps of up to this many tokens on a GPU. vLLM 0.26 captures them for up to min(2 x max_num_seqs,
# 512) tokens, and at its full batch (1,024 in flight on an H100/H200) a step holds ~900-1,700: without this, every
# step's forward ran kernel by kernel from Python (py-spy, run26) while the GPU idled. On the 1.5B (run28, an H100):
# a step x0.71 with or without the grammar, a whole 6,000-row run x0.97, its engine start within the runs' spread
# (BENCHMARKS.md, "What the JSON constraint costs a step"). vLLM drops the sizes above its max_num_batched_tokens.
GRAPH_TOKENS = 2048


def graph_sizes(largest: int) -> list[int]:
    """CUDA graph capture sizes (tokens a step) up to `largest`: vLLM's own list to 512 ([1, 2, 4], every 8 to 256,
    every 16 to 512), then every 128 to 1,024 and every 256 beyond: the coarse sizes pad a step by up to 255 tokens,
    on a GPU that is mostly idle at those steps, for few captures at the engine's start."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16), *range(640, 1025, 128), *range(1280, largest + 1, 256)]
    return [size for size in sizes if size <= largest]


def engine_kwargs(model: ModelSpec, decoding: DecodingSpec, backend: str, speculative: SpeculativeSpec | None,
                  cpu: bool, schema: dict | None = None) -> dict[str, Any]:
    """The keyword arguments of `vllm.LLM` for one engine: `backend` decodes the grammar, `speculative` (None: no
    speculation) drafts, on a CPU (`cpu`) or a GPU; `schema`: the grammar's JSON Schema, which the schema drafter
    follows; `[model.engine]` goes last and overrides any of them."""
    drafting = speculative is not None and speculative.enabled
    kwargs: dict[str, Any] = dict(
        # vLLM's stats only where the draft's counters are read (llm.get_metrics()): elsewhere they are work in every
        # step of the engine core and the front end for nothing (as in bare vLLM's LLM, where they are off).
        model=resolve_model(model.path), dtype=model.dtype, disable_log_stats=not drafting,
        # Per-request disable_any_whitespace is ignored by vLLM: the grammar settings are engine-wide.
        structured_outputs_config={"backend": backend, "disable_any_whitespace": model.disable_any_whitespace},
    )
    if model.max_model_len:
        kwargs["max_model_len"] = model.max_model_len
    if cpu:
        kwargs["enforce_eager"] = True  # compiling costs a minute per start on CPU and gains little there
        kwargs["dtype"] = cpu_dtype(model.dtype)
        # A per-request seed kills the CPU engine once a prefill is chunked ("CPU Generator does not use
        # offset"): seed the engine instead, which is reproducible for the same input and settings.
        if decoding.seed is not None:
            kwargs["seed"] = decoding.seed
    elif not drafting:  # drafted steps (1 + k tokens a request) with these graphs: not measured, vLLM's own
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": graph_sizes(GRAPH_TOKENS)}
    if drafting:
        kwargs["speculative_config"] = speculative_config(speculative, schema)
    return kwargs | model.engine


def engine_settings(model: ModelSpec, decoding: DecodingSpec, schema: dict | None,
                    speculative: SpeculativeSpec | None, cpu: bool) -> tuple[Any, dict[str, Any]]:
    """The grammar backend's choice (schema/grammar.py) and `vllm.LLM`'s keyword arguments of an engine with these
    settings (none where no backend can take the schema)."""
    choice = choose(schema, decoding.structured_output_backend or model.structured_output_backend,
                    model.disable_any_whitespace)
    drafting = speculative if speculative is not None and speculative.enabled else None
    return choice, (engine_kwargs(model, decoding, choice.backend, drafting, cpu, choice.grammar_schema)
                    if choice.backend else {})


def speculative_config(spec: SpeculativeSpec, schema: dict | None = None) -> dict[str, Any]:
    """vLLM's speculative_config for `spec`; `[speculative.options]` goes last and overrides any of it. "schema" is
    batchjson's drafter (the tokens the grammar forces, copies from the prompt; `schema`: the grammar's JSON Schema,
    None for any JSON object): the method it registered where vLLM has a registry of them (0.34's Model Runner V2:
    engine/vllm/schema_speculator/), else vLLM's custom_class proposer (engine/vllm/drafts.py)."""
    if spec.method == "schema":
        if schema_speculator.register():
            return schema_speculator.speculative_config(spec.num_speculative_tokens, schema, spec.options)
        if why := drafts.schema_drafts_unready():
            raise EngineError(f'speculative.method = "schema" cannot run here ({why}): choose another method '
                              '(auto, suffix, ngram, none).')
        return {"method": "custom_class", "model": drafts.SCHEMA_PROPOSER,
                "num_speculative_tokens": spec.num_speculative_tokens} | spec.options
    config: dict[str, Any] = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
                              "draft_sample_method": spec.draft_sample_method}
    if spec.method == "ngram":
        config |= {"prompt_lookup_min": spec.prompt_lookup_min, "prompt_lookup_max": spec.prompt_lookup_max}
    if spec.draft_model:
        config["model"] = resolve_model(spec.draft_model)
    return config | spec.options


class VllmEngine(Engine):
    """One vllm.LLM with one pass's settings: the target decodes under the JSON constraint, the draft does not.

    `speculative` is the draft's configuration (None: no speculation). vLLM V1 proposes draft tokens without
    the grammar, cuts each draft to its grammar-valid prefix, and verifies it with one bitmask per position.
    """

    def __init__(self, model: ModelSpec, decoding: DecodingSpec, schema: dict | None,
                 speculative: SpeculativeSpec | None = None):
        self.llm = None
        self._closed = threading.Event()
        self._stepping_since: float | None = None  # when the step now waited for began (the hang watchdog)
        vllm = _vllm()
        from vllm.platforms import current_platform
        from vllm.sampling_params import StructuredOutputsParams
        from vllm.v1.engine.exceptions import EngineDeadError

        self._dead = EngineDeadError
        # Requests vLLM refuses when they are added: ValueError, or VLLMClientError (no longer a ValueError in 0.32).
        self._refused = (ValueError, getattr(importlib.import_module("vllm.exceptions"), "VLLMClientError", ValueError))

        self.max_in_flight = model.max_in_flight
        # The speculation audit: a twin without drafts of pass 1's first greedy rows (`use` makes its settings),
        # compared token for token when both are done.
        self.audit = {"rows": 0, "differ": 0}
        self._audit_left = speculative.audit_rows if speculative is not None and speculative.enabled else 0
        self._twin_params: dict[str, Any] = {}  # stage -> its settings without drafts, where the stage is audited
        self.steps = 0  # engine steps taken so far (ms per step, tokens per step)
        self.step_s = 0.0  # ... and the seconds spent in them
        self.unfinished: list[Prompt] = []
        # vLLM refuses its own "auto" with disable_any_whitespace: batchjson picks the backend, and gives it the
        # schema minus what it cannot compile (validation checks that part).
        self._schema = schema
        self._cpu = current_platform.is_cpu()
        self.choice, kwargs = engine_settings(model, decoding, schema, speculative, self._cpu)
        if not self.choice.backend:
            raise EngineError(f"{self.choice.reason}. Simplify the schema, or set model.structured_output_backend to "
                              "a backend (xgrammar, guidance, outlines); `batchjson check` shows each one's answer.")
        self.seed = decoding.seed
        self.backend = self.choice.backend
        self.speculative = speculative if speculative is not None and speculative.enabled else None
        self._model = model
        self._constraint = (StructuredOutputsParams(json=self.choice.grammar_schema) if schema is not None
                            else StructuredOutputsParams(json_object=True))
        self._sampling = vllm.SamplingParams
        self.params: dict[str, Any] = {}  # stage -> SamplingParams
        # Requests without a draft on a speculative engine (pass 2): through batchjson's scheduler patch.
        plugin.install_pending()  # a local replica's (before its engine exists, as the engine may fork from it)
        patches.install_in_runner()  # the plugin installs them all in vLLM's processes
        self.no_draft = self.speculative is not None and scheduler.no_draft_ready()
        self.notice, self.notice_code = versions.notice(), versions.notice_code()
        self.use(decoding)
        # The engine processes fill the grammar's masks as the spec says (its plugin reads this before the first step).
        os.environ[fills.GRAMMAR_FILLS_ENV] = model.grammar_fills
        self.fills = patches.grammar_fills(model.grammar_fills)
        # The KV cache's size vLLM measured for these settings before, if it did (kv_sizes.py): given, vLLM skips the
        # measurement; else the engine core reports what it measures, kept for the next start.
        config, self.kv_kept = kv_sizes.sized(kwargs, self._cpu)
        if self.kv_kept:
            kwargs[kv_sizes.GIVEN] = self.kv_kept
        report = Path(tempfile.mkdtemp(prefix="batchjson-kv-")) / "bytes" if config and not self.kv_kept else None
        if report:
            os.environ[kv.KV_SIZE_ENV] = str(report)
        try:
            with reaper.guard():  # its processes die with this one, however and whenever it dies
                self.llm = vllm.LLM(**kwargs)
        except (ValueError, TypeError, OSError, ImportError, RuntimeError) as e:
            # RuntimeError: the engine process failed to start (its own error is logged above), or CUDA memory.
            kv_sizes.forget(config if self.kv_kept else None)  # the next start measures again
            taken = "" if self._cpu else devices.memory_taken(
                kwargs.get("gpu_memory_utilization", devices.VLLM_GPU_MEMORY_UTILIZATION))
            raise EngineError(f"vLLM could not start with model {kwargs['model']}: {e}. "
                              + (taken or "Check [model], [model.engine] and [speculative].")) from e
        finally:
            if report:
                os.environ.pop(kv.KV_SIZE_ENV, None)
                with contextlib.suppress(OSError, ValueError):
                    kv_sizes.keep(config, int(report.read_text()))
                shutil.rmtree(report.parent, ignore_errors=True)
        self.tokenizer = self.llm.get_tokenizer()
        if self.max_in_flight is None:  # the engine's batch, and as many waiting behind it
            self.max_in_flight = 2 * (processes.batch_size(self.llm) or 256)
        self._probe(kwargs["structured_outputs_config"]["backend"], decoding)
        # A killed engine process becomes EngineDeadError in step(), which stream() handles (else step() hangs).
        processes.watch_engine_processes(self.llm, self._closed, self._dead, self._hung)

    def accepts(self, decoding: DecodingSpec, speculative: SpeculativeSpec | None) -> bool:
        """Whether a pass with these settings can run on this engine: sampling is per request, but the grammar
        backend, whitespace and speculation are engine-wide (and on CPU the seed is too)."""
        backend = choose(self._schema, decoding.structured_output_backend or self._model.structured_output_backend,
                         self._model.disable_any_whitespace).backend
        wanted = speculative if speculative is not None and speculative.enabled else None
        seed_ok = not self._cpu or decoding.seed is None or decoding.seed == self.seed
        draft_ok = wanted == self.speculative or (wanted is None and self.no_draft)
        return backend == self.backend and draft_ok and seed_ok

    def use(self, decoding: DecodingSpec, stage: Stage = Stage.FIRST, draft: bool = True) -> None:
        """Decode prompts of `stage` with these sampling settings (per request: no engine restart)."""
        if not draft and self.speculative is not None and not self.no_draft:
            raise EngineError("[internal] this engine cannot decode requests without a draft")
        try:
            self.params[stage] = self._params(decoding, no_draft=not draft and self.speculative is not None)
            self._twin_params.pop(stage, None)
            if draft and self.no_draft and self._audit_left and decoding.temperature == 0 and decoding.n == 1:
                self._twin_params[stage] = self._params(decoding, no_draft=True, twin=True)
        except (TypeError, *self._refused) as e:
            raise EngineError(f"vLLM refuses these sampling settings: {e}. Fix [sampling] or [fallback].") from None

    def _params(self, decoding: DecodingSpec, no_draft: bool, twin: bool = False):
        return self._sampling(
            temperature=decoding.temperature, top_p=decoding.top_p, max_tokens=decoding.max_tokens,
            repetition_penalty=decoding.repetition_penalty, frequency_penalty=decoding.frequency_penalty,
            presence_penalty=decoding.presence_penalty, seed=None if self._cpu else decoding.seed, n=decoding.n,
            structured_outputs=self._constraint, extra_args=self._extra(no_draft, twin),
            **self._repetition(decoding.repetition_detection))

    @staticmethod
    def _extra(no_draft: bool, twin: bool) -> dict | None:
        """SamplingParams.extra_args: no draft for this request (pass 2 on pass 1's engine), or an audit's twin."""
        if not no_draft:
            return None
        return {scheduler.NO_DRAFT: True, scheduler.AUDIT_TWIN: True} if twin else {scheduler.NO_DRAFT: True}

    def _hung(self) -> str:
        """Why the engine is taken for hung ("" while it is not): one step has not returned for hang_timeout_s.
        vLLM's engine core answers every step, so with requests in flight a silent engine is a stuck one."""
        since = self._stepping_since
        if since is None or time.monotonic() - since <= self._model.hang_timeout_s:
            return ""
        return f"hung: no engine step for {self._model.hang_timeout_s:.0f} s (model.hang_timeout_s) with requests in flight"

    def _probe(self, backend: str, decoding: DecodingSpec) -> None:
        """Fail at start, not on every row, when the grammar backend cannot take the schema. The probe asks for no
        draft where the engine can decode without one: its abort may reach the engine core after a step, and a
        drafted probe would run the drafter in a step the user's rows never asked for."""
        try:
            (request_id,) = self.llm.enqueue("{", self._params(decoding, no_draft=self.no_draft), use_tqdm=False)
        except self._refused as e:
            self.close()
            raise EngineError(f"the {backend} structured-output backend cannot use this JSON Schema: {e}. "
                              "Set model.structured_output_backend (or fallback.structured_output_backend) to "
                              "another backend (xgrammar, guidance, outlines), or simplify the schema.") from None
        processes.abort_internal(self.llm, request_id)

    def _repetition(self, settings: dict | None) -> dict[str, Any]:
        if not settings:
            return {}
        from vllm.sampling_params import RepetitionDetectionParams

        try:
            return {"repetition_detection": RepetitionDetectionParams(**settings)}
        except (TypeError, *self._refused) as e:
            raise EngineError(f"repetition_detection {settings}: {e}") from None

    def stream(self, prompts: Iterable[Prompt], stop: threading.Event | None = None) -> Iterator[Generation]:
        """Keep up to max_in_flight requests in the engine; yield each result as soon as it finishes.

        A request the engine refuses when added (e.g. longer than max_model_len) comes back as a failed
        Generation at once; it never aborts the others, as one bad prompt does in LLM.generate. When `stop`
        is set, the stream ends at the next step and drops what is in flight. If the engine process dies,
        EngineDied carries the prompts that were in flight.
        """
        in_flight: dict[str, Prompt] = {}
        self.unfinished = []
        self._twins: dict[str, str] = {}  # an audit twin's request id -> its row's request id
        self._answers: dict[str, list] = {}  # an audited row's request id -> [its tokens, its twin's], as they come
        try:
            yield from self._stream(iter(prompts), in_flight, stop or threading.Event())
        except Exception as e:
            # EngineDeadError, or whatever a call racing vLLM's own cleanup of a dead engine meets (a closed socket)
            if not isinstance(e, self._dead) and not processes.is_dead(self.llm):
                raise
            raise EngineDied(list(in_flight.values()), e) from e
        finally:
            # Stopped, or the caller failed mid-stream: requests left in the engine must not finish into a later
            # stream on the same engine. `unfinished` says which they were (another engine may take them over).
            in_flight.pop("adding", None)
            self.unfinished = list(in_flight.values())
            left = [*in_flight, *self._twins]
            if left and not self._closed.is_set():
                try:
                    self.llm.llm_engine.abort_request(left)
                except Exception:  # a dead engine has nothing left to abort
                    pass

    def _stream(self, pending: Iterator[Prompt], in_flight: dict[str, Prompt], stop: threading.Event):
        engine = self.llm.llm_engine
        exhausted = False
        while not stop.is_set():
            waiting = False
            while not exhausted and len(in_flight) < self.max_in_flight:
                prompt = next(pending, None)
                if prompt is None:
                    exhausted = True
                    break
                if prompt is WAIT:
                    waiting = True
                    break
                in_flight["adding"] = prompt  # a dying engine fails this call: the prompt goes back too
                try:
                    (request_id,) = self.llm.enqueue(prompt.text, self.params[prompt.stage], use_tqdm=False)
                except self._dead:
                    raise
                except self._refused as e:
                    del in_flight["adding"]
                    too_long = any(m in str(e) for m in ("maximum context length", "longer than the maximum model length"))
                    yield Generation(prompt, error="prompt_too_long" if too_long else "engine_error", detail=str(e)[:500])
                    continue
                # Outputs carry the caller's id; newer vLLM returns it with a random suffix ("7-1a2b3c4d").
                key = request_id.split("-", 1)[0]
                in_flight[key] = in_flight.pop("adding")
                twin = self._twin_params.get(prompt.stage)
                if twin is not None and self._audit_left > 0:
                    self._audit_left -= 1
                    (twin_id,) = self.llm.enqueue(prompt.text, twin, use_tqdm=False)
                    self._twins[twin_id.split("-", 1)[0]], self._answers[key] = key, [None, None]
            if not in_flight and not (exhausted and self._twins):  # the last audit twins are waited for
                if exhausted:
                    return
                if waiting:
                    time.sleep(0.01)
                continue
            self.steps += 1
            self._stepping_since = began = time.monotonic()  # the hang watchdog's clock (see _hung)
            outputs = engine.step()
            self._stepping_since = None
            self.step_s += time.monotonic() - began
            for out in outputs:
                if not out.finished:
                    continue
                if out.request_id in self._twins:  # an audit twin: compared, never yielded
                    self._audited(self._twins.pop(out.request_id), 1, out)
                    continue
                if out.request_id in self._answers:
                    self._audited(out.request_id, 0, out)
                prompt = in_flight.pop(out.request_id)
                prompt_tokens = len(out.prompt_token_ids or ())
                candidates = [self._generation(prompt, c, prompt_tokens) for c in out.outputs]
                gen = candidates[0]
                if len(candidates) > 1:  # n > 1: the validator keeps the first valid candidate
                    gen = Generation(prompt, gen.text, gen.finish_reason, prompt_tokens,
                                     sum(c.output_tokens for c in candidates), gen.error, gen.detail, candidates)
                yield gen

    def _audited(self, row: str, which: int, out: Any) -> None:
        """One of an audited row's two answers (0: with drafts, 1: its twin without): compared once both came."""
        answers = self._answers[row]
        answers[which] = list(out.outputs[0].token_ids) if out.outputs else []
        if None not in answers:
            del self._answers[row]
            self.audit["rows"] += 1
            self.audit["differ"] += answers[0] != answers[1]

    @staticmethod
    def _generation(prompt: Prompt, completion: Any, prompt_tokens: int) -> Generation:
        gen = Generation(prompt, completion.text, completion.finish_reason or "", prompt_tokens,
                         len(completion.token_ids))
        if gen.finish_reason in ("abort", "error"):
            gen.error, gen.detail = "engine_error", f"the engine ended the request ({gen.finish_reason})"
        return gen

    def facts(self) -> EngineFacts:
        grammar = self.choice.summary + (f"; masks: {self.fills}" if self.fills else "")
        return EngineFacts(self.steps, self.step_s, grammar, self.notice, self.notice_code, self.kv_kept,
                           self.audit["rows"], self.audit["differ"])

    def stats(self) -> dict[str, float]:
        """Speculative decoding counters from the engine's metrics (zero without speculation)."""
        names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
        out = dict.fromkeys(names.values(), 0.0)
        if self.audit["rows"]:  # the speculation audit's rows and those whose answer differed without drafts
            out |= {"audit_rows": self.audit["rows"], "audit_differ": self.audit["differ"]}
        if self.speculative is None or not processes.stats_on(self.llm):  # no draft, or stats off ([model.engine])
            return out
        for metric in self.llm.get_metrics():
            if metric.name in names and hasattr(metric, "value"):
                out[names[metric.name]] += metric.value
        return out

    def close(self) -> None:
        """Shut the engine process down and free its memory, so the next pass can start its own."""
        if self.llm is None:
            return
        self._closed.set()
        processes.shut_down(self.llm)
        self.llm = None
        gc.collect()


class VllmEngines(EngineFactory):
    """The default engine factory: a VllmEngine per start."""

    def start(self, spec: JobSpec, decoding: DecodingSpec, speculative: SpeculativeSpec | None) -> VllmEngine:
        return VllmEngine(spec.model, decoding, spec.schema_doc, speculative)

    def measures(self, spec: JobSpec, decoding: DecodingSpec, speculative: SpeculativeSpec | None) -> bool:
        """Whether its start would measure the GPU's memory: not where vLLM measured these settings before on this
        kind of GPU (kv_sizes.py), nor where the job gives the KV cache's size."""
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
        try:
            choice, kwargs = engine_settings(spec.model, decoding, spec.schema_doc, speculative, cpu)
        except EngineError:
            return True
        return not choice.backend or (kv_sizes.GIVEN not in kwargs and not kv_sizes.sized(kwargs, cpu)[1])

    @property
    def drafts_optional(self) -> bool:
        return scheduler.no_draft_ready()

    @property
    def schema_drafts(self) -> bool:
        return schema_speculator.register() or not drafts.schema_drafts_unready()
