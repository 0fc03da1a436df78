"""The grammar stage's choices: which backend decodes a job's schema, the schema it is given, and what it enforces.

vLLM hands a JSON Schema to one grammar backend per engine. Backends refuse some schemas outright (vLLM's request
check) and silently weaken or tighten others. batchjson therefore gives the backend a *grammar schema*: the job's
schema with what that backend cannot compile removed (never added), so the grammar accepts every valid answer the
backend can represent, and validation (jsonschema, the source of truth) checks what was removed.

No vLLM import here: the backends' own libraries (xgrammar, llguidance) build the grammar on CPU, configured the way
vLLM configures them for a batchjson job, so `batchjson check` answers in a second without an engine.

Over 250 lines: relaxing a schema, choosing a backend and reporting coverage read the same per-backend tables (what
each compiles, what each enforces while decoding), and are kept with them. What a schema is made of, whatever the
backend (subschemas, drafts, refs, root types), is shape.py's.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from batchjson.schema.shape import KEYWORDS, declared_draft, local_refs, subschemas, types_of

# Candidates of "auto", best first. On the tasks with ground truth (BENCHMARKS.md, "GPU-seconds per valid row"),
# the same job gave 206 correct rows of 600 on xgrammar and 32 on llguidance: xgrammar's strict objects (no
# undeclared property) keep a small model on the declared keys, where llguidance lets it wander. On the SchemaStore
# corpus ("Schemas") llguidance blocks fewer valid answers, mostly the same undeclared properties; it stays the
# fallback for schemas xgrammar cannot build. outlines is left out of "auto": it allows free whitespace whatever
# disable_any_whitespace says, and its regex for large schemas ran out of memory on the corpus.
AUTO_ORDER = ("xgrammar", "guidance")
BACKENDS = ("xgrammar", "guidance", "outlines")
BUILD_LIMIT_S = 600.0
"""A grammar build that runs longer than this counts as a refusal of the schema. The choice of "auto" must not
depend on the machine's load: the SchemaStore corpus's slowest build took xgrammar 4.0 s and llguidance 0.17 s
(BENCHMARKS.md, "Schemas"), and a busy 2-core machine took 4.5-6.2 s for the sample job's grammar when the backend's
import was timed with it, so the limit is 150 times the slowest build measured, which no busy machine reaches: below
it, a backend is chosen by whether it builds the schema, the same answer on any machine."""

_LOOKAROUND = re.compile(r"\(\?<?[=!]|\\[1-9]|\\[pPkKZzGA]|\(\?[a-zA-Z]+\)|\(\?P[<=]")
# Formats xgrammar turns into a grammar (vLLM refuses the others for xgrammar).
XGRAMMAR_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                              "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})

# What each backend enforces while decoding, among the keywords it is given (measured: BENCHMARKS.md). Keywords
# outside the set are checked by validation only.
ENFORCED = {
    "xgrammar": frozenset("""type enum const maximum exclusiveMaximum minimum exclusiveMinimum maxLength minLength
        pattern format maxItems minItems required properties patternProperties additionalProperties items prefixItems
        anyOf $ref $defs definitions minProperties maxProperties""".split()),
    "guidance": frozenset("""type enum const maximum exclusiveMaximum minimum exclusiveMinimum maxLength minLength
        pattern format maxItems minItems required properties patternProperties additionalProperties items prefixItems
        anyOf oneOf allOf $ref $defs definitions minProperties maxProperties multipleOf""".split()),
}
ENFORCED["outlines"] = ENFORCED["xgrammar"]
# xgrammar (0.2.8 and 0.2.9) decodes a string with minLength or maxLength as characters other than ", \ and line
# breaks: no escape (\", \\, \n, \u) can be written in it, while raw control characters (a tab), which JSON forbids,
# can. Such a string also costs more to fill: task C's schema, 1,024 requests, Qwen's tokenizer, one thread, 195.6 ms
# a step against 14.9 without its minLength on 0.2.8, 22.2 against 17.0 on 0.2.9 (BENCHMARKS.md, "What the JSON
# constraint costs a step", `bench grammar --matchers`). minLength is given to validation: in the grammar it only forbids short values, which validation
# finds. maxLength stays in the grammar, hole and all, because it ends a string a model would otherwise write until
# max_tokens; `batchjson check` names the hole (a pattern has it too: xgrammar matches it on the string's raw text).
XGRAMMAR_MIN_LENGTH = ("xgrammar's bounded strings take no escapes (\\\", \\\\, \\n) and let raw control characters "
                       "through, and cost up to 13x to fill: the minimum length is validation's")
XGRAMMAR_BOUNDED_HOLE = ("a string with maxLength or a pattern, where xgrammar's grammar lets no escape in (\\\", "
                         "\\\\, \\n, \\u)")
_WHY_HOLE = {"oneOf": "oneOf is decoded as anyOf (no 'exactly one')", "format": "format not in the grammar",
             "uniqueItems": "unique items", "not": "not", "if": "if/then/else", "then": "if/then/else",
             "else": "if/then/else", "multipleOf": "multipleOf", "allOf": "allOf of several branches"}


@dataclass(frozen=True)
class Relaxed:
    """A backend's grammar schema and what was taken out of the job's schema to get it."""

    backend: str
    schema: dict
    dropped: tuple[tuple[str, str, str], ...] = ()
    """(JSON pointer, keyword, why) for each constraint left to validation."""


def relax(schema: dict, backend: str, disable_any_whitespace: bool = True) -> Relaxed:
    """The grammar schema for `backend`: the job's schema minus what the backend cannot compile or vLLM refuses."""
    doc, _ = local_refs(schema)
    draft = declared_draft(schema)
    dropped: list[tuple[str, str, str]] = []

    def drop(path, node, key, why):
        if key in node:
            del node[key]
            dropped.append((path or "/", key, why))

    for path, node in list(subschemas(doc)):
        for key in [k for k in node if k not in KEYWORDS or k in ("$comment", "$schema", "$id", "id", "$vocabulary")]:
            if key in ("$schema", "$id", "id") and path == "":
                continue
            del node[key]  # annotations and extensions constrain nothing
        if "$ref" in node and draft <= 7:
            for key in [k for k in node if k not in ("$ref", "definitions", "$defs")]:
                del node[key]  # before 2019-09 a $ref's siblings are ignored: validation ignores them too
        if isinstance(node.get("items"), list):  # draft 4-7 tuples, in the 2020-12 form both backends know
            node["prefixItems"] = node.pop("items")
            extra = node.pop("additionalItems", True)
            node["items"] = {} if extra is True else extra
        if isinstance(node.get("pattern"), str) and _LOOKAROUND.search(node["pattern"]):
            drop(path, node, "pattern", "look-around or back-reference: no grammar backend can decode it")
        if isinstance(node.get("format"), str) and node["format"] not in XGRAMMAR_FORMATS:
            drop(path, node, "format", f"format {node['format']!r} has no grammar")
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if isinstance(node.get(key), (int, float)) and not isinstance(node[key], bool) and abs(node[key]) > 2**53:
                drop(path, node, key, "a bound beyond 2^53 has no grammar")
        if backend in ("xgrammar", "outlines"):
            _relax_xgrammar(path, node, drop)
            if backend == "xgrammar":
                drop(path, node, "minLength", XGRAMMAR_MIN_LENGTH)
        else:
            _relax_guidance(path, node, drop)
    if backend == "guidance":
        # Options the grammar compiler reads from the schema itself: ignore keywords it cannot decode (validation
        # checks them) and decode oneOf as anyOf; no free whitespace when the job forbids it.
        doc["x-guidance"] = {"lenient": True, "coerce_one_of": True, "whitespace_flexible": not disable_any_whitespace}
    return Relaxed(backend, doc, tuple(dropped))


def _relax_xgrammar(path: str, node: dict, drop) -> None:
    """What vLLM's request check refuses for xgrammar (has_xgrammar_unsupported_json_features), removed."""
    if "array" in types_of(node) and "items" not in node and "prefixItems" not in node:
        node["items"] = {}  # strict mode would otherwise allow only the empty array
    drop(path, node, "multipleOf", "xgrammar has no multipleOf")
    for key in ("uniqueItems", "contains", "minContains", "maxContains"):
        drop(path, node, key, f"xgrammar has no {key}")
    if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        drop(path, node, "minLength", "xgrammar cannot combine a length with a pattern or format")
        drop(path, node, "maxLength", "xgrammar cannot combine a length with a pattern or format")
    if "propertyNames" in node:
        drop(path, node, "propertyNames", "xgrammar cannot combine propertyNames with other object keywords")
    if isinstance(node.get("patternProperties"), dict) and ("properties" in node or len(node["patternProperties"]) > 1):
        drop(path, node, "patternProperties", "xgrammar cannot combine patternProperties with properties")
        node.setdefault("additionalProperties", True)
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) >= 2:
        drop(path, node, "allOf", "xgrammar has no allOf of several branches")
    for key in ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
                "unevaluatedProperties", "unevaluatedItems"):
        drop(path, node, key, f"xgrammar has no {key}")


def _relax_guidance(path: str, node: dict, drop) -> None:
    if ("minProperties" in node or "maxProperties" in node) and set(node.get("properties") or ()) - set(
            node.get("required") or ()):
        drop(path, node, "minProperties", "llguidance counts properties only when all are required")
        drop(path, node, "maxProperties", "llguidance counts properties only when all are required")


@dataclass(frozen=True)
class Trial:
    backend: str
    ok: bool
    seconds: float
    error: str = ""


@dataclass(frozen=True)
class Choice:
    """The backend one pass decodes with, its grammar schema, and why it was chosen."""

    backend: str
    relaxed: Relaxed | None
    reason: str
    trials: tuple[Trial, ...] = field(default=())

    @property
    def grammar_schema(self) -> dict | None:
        return self.relaxed.schema if self.relaxed else None

    @property
    def summary(self) -> str:
        return f"{self.backend} ({self.reason})" if self.backend else self.reason


@contextmanager
def _quiet_stderr():
    """xgrammar's C++ code prints a warning line per weakened keyword on fd 2; coverage says it in one place."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def build(relaxed: Relaxed, disable_any_whitespace: bool = True):
    """Build the backend's grammar for the grammar schema, as vLLM does when it checks a request; raises on refusal."""
    schema = relaxed.schema
    if relaxed.backend == "xgrammar":
        import xgrammar as xgr

        with _quiet_stderr():
            return xgr.Grammar.from_json_schema(schema, any_whitespace=not disable_any_whitespace,
                                                separators=(",", ":") if disable_any_whitespace else None)
    if relaxed.backend == "guidance":
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": not disable_any_whitespace})
        error = llguidance.LLMatcher.validate_grammar(grammar, None)
        if error:
            raise ValueError(error)
        return grammar
    if relaxed.backend == "outlines":
        from outlines_core import json_schema

        return json_schema.build_regex_from_schema(json.dumps(schema))
    raise ValueError(f"unknown backend {relaxed.backend!r}")


def _timed_build(relaxed: Relaxed, disable_any_whitespace: bool, limit_s: float) -> Trial:
    """Build in a worker thread, so that a build that never ends is a refusal after `limit_s`. The backend's library
    is imported before the clock starts: an import on a busy machine took seconds, a build milliseconds."""
    _import_backend(relaxed.backend)
    result: list = []

    def work():
        t = time.perf_counter()
        try:
            build(relaxed, disable_any_whitespace)
            result.append(Trial(relaxed.backend, True, time.perf_counter() - t))
        except Exception as e:  # a refusal of this backend, not a batchjson bug
            result.append(Trial(relaxed.backend, False, time.perf_counter() - t, _first_line(e)))

    worker = threading.Thread(target=work, daemon=True, name=f"batchjson-grammar-{relaxed.backend}")
    worker.start()
    worker.join(limit_s)
    return result[0] if result else Trial(relaxed.backend, False, limit_s, f"its build ran over {limit_s:g}s")


def _import_backend(backend: str) -> None:
    module = {"xgrammar": "xgrammar", "guidance": "llguidance", "outlines": "outlines_core"}.get(backend)
    if module:
        importlib.import_module(module)


def _auto_reason(trials: list[Trial]) -> str:
    """Why "auto" took the last of `trials`: the backends before it refused the schema; the build's time is shown,
    not weighed."""
    chosen, built = trials[-1], f"{trials[-1].seconds * 1000:.0f} ms"
    refused = "; ".join(f"{t.backend} refused it: {t.error}" for t in trials[:-1])
    if refused:
        return f"auto: {refused}; {chosen.backend} built it in {built}"
    return f"auto: the first of {'/'.join(AUTO_ORDER)}, and it builds this schema; built in {built}"


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


_CACHE: dict[tuple, Choice] = {}


def choose(schema: dict | None, backend: str = "auto", disable_any_whitespace: bool = True,
           limit_s: float = BUILD_LIMIT_S) -> Choice:
    """The backend to decode `schema` with. "auto" takes the first of AUTO_ORDER that builds the schema's grammar:
    what decides is whether a backend refuses the schema, never how long it took, so a job decodes alike on a busy
    machine and an idle one. An explicit backend is kept (its grammar schema is still relaxed so vLLM accepts it)."""
    key = (json.dumps(schema, sort_keys=True), backend, disable_any_whitespace, limit_s, AUTO_ORDER)
    if key in _CACHE:
        return _CACHE[key]
    if schema is None:
        chosen = "xgrammar" if backend == "auto" else backend
        choice = Choice(chosen, None, "any JSON object (json_object = true)" if backend == "auto" else "set in the spec")
    elif backend != "auto":
        relaxed = relax(schema, backend, disable_any_whitespace) if backend in BACKENDS else None
        trial = _timed_build(relaxed, disable_any_whitespace, limit_s) if relaxed else None
        reason = "set in the spec"
        if trial and not trial.ok:
            reason += f"; it refuses this schema here: {trial.error}"
        choice = Choice(backend, relaxed, reason, (trial,) if trial else ())
    else:
        trials = []
        choice = None
        for name in AUTO_ORDER:
            relaxed = relax(schema, name, disable_any_whitespace)
            trial = _timed_build(relaxed, disable_any_whitespace, limit_s)
            trials.append(trial)
            if trial.ok:
                choice = Choice(name, relaxed, _auto_reason(trials), tuple(trials))
                break
        if choice is None:
            why = "; ".join(f"{t.backend}: {t.error}" for t in trials)
            choice = Choice("", None, f"no grammar backend builds this schema ({why})", tuple(trials))
    _CACHE[key] = choice
    return choice


@dataclass(frozen=True)
class Coverage:
    """Where each constraint of the schema is checked."""

    backend: str
    enforced: tuple[str, ...]
    """Keywords the grammar enforces while decoding."""
    validation_only: tuple[tuple[str, str], ...]
    """(keyword, why) checked only after decoding: such rows fail as `schema` and go to the fallback pass."""
    over_constrained: tuple[tuple[str, str], ...]
    """(JSON pointer, what) where the grammar forbids answers the schema allows."""

    def lines(self, limit: int = 4) -> list[str]:
        out = [f"grammar enforces: {', '.join(self.enforced) or 'JSON syntax only'}"]
        if self.validation_only:
            out.append("validation only (the grammar lets these through; failures go to the fallback pass): "
                       + ", ".join(f"{k} ({why})" if why else k for k, why in self.validation_only))
        if self.over_constrained:
            where: dict[str, list[str]] = {}
            for p, what in self.over_constrained:
                where.setdefault(what, []).append(p)
            shown = "; ".join(", ".join(paths[:limit]) + (f" and {len(paths) - limit} more" if len(paths) > limit
                                                           else "") + f": {what}" for what, paths in where.items())
            out.append(f"over-constrained (the grammar may block a correct answer): {shown}")
        return out


def coverage(schema: dict | None, choice: Choice) -> Coverage:
    """Which keywords of `schema` the chosen backend enforces, which only validation checks, and where its grammar
    forbids what the schema allows."""
    if schema is None or choice.relaxed is None:
        return Coverage(choice.backend, (), (), ())
    backend = choice.backend
    used: dict[str, None] = {}
    for _, node in subschemas(local_refs(schema)[0]):
        for key in node:
            if key in KEYWORDS and key not in ("$schema", "$id", "id", "$comment", "$defs", "definitions", "$anchor"):
                used.setdefault(key, None)
    dropped = {k: why for _, k, why in choice.relaxed.dropped}
    enforced = ENFORCED.get(backend, frozenset())
    kept = tuple(k for k in used if k in enforced and k not in dropped)
    only: dict[str, str] = {}
    for k in used:
        if k in dropped:
            only.setdefault(k, dropped[k])
        elif k not in enforced:
            only.setdefault(k, _WHY_HOLE.get(k, ""))
        elif k == "oneOf":
            only.setdefault(k, _WHY_HOLE["oneOf"])
    over: list[tuple[str, str]] = []
    if backend == "xgrammar":
        for path, node in subschemas(choice.relaxed.schema):
            if ("properties" in node or "object" in types_of(node)) and "additionalProperties" not in node \
                    and "patternProperties" not in node:
                over.append((path or "/", "undeclared properties (additionalProperties unset: xgrammar's strict "
                                           "mode forbids them; set it to true in the schema to allow them)"))
            if "maxLength" in node or "pattern" in node:
                over.append((path or "/", XGRAMMAR_BOUNDED_HOLE))
    return Coverage(backend, kept, tuple(only.items()), tuple(over))


class _ByteVocabulary:
    """A 256-token vocabulary (one token per byte) plus an end token: lets llguidance match a text byte by byte."""

    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([i]) for i in range(256)] + [b"<end>"]

    def __call__(self, text):
        return list(text if isinstance(text, bytes) else text.encode())


def grammar_accepts(relaxed: Relaxed, text: str, disable_any_whitespace: bool = True) -> bool:
    """Whether the backend's grammar for `relaxed` lets `text` through whole: what coverage and the corpus
    measurement rest on (a valid answer refused is an over-constraint, an invalid one accepted a hole)."""
    grammar = build(relaxed, disable_any_whitespace)
    if relaxed.backend == "xgrammar":
        from xgrammar.testing import _is_grammar_accept_string

        with _quiet_stderr():
            return _is_grammar_accept_string(grammar, text)
    if relaxed.backend == "guidance":
        import llguidance

        global _BYTES
        if _BYTES is None:
            _BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()))
        matcher = llguidance.LLMatcher(_BYTES, grammar, log_level=0)
        return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting() and not matcher.is_error()
    raise ValueError(f"grammar_accepts: no matcher for {relaxed.backend}")


_BYTES = None
