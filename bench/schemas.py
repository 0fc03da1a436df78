"""Schemas users have: the SchemaStore corpus through batchjson's spec loader, grammar backends and Validator.

    python -m bench schemas [--corpus bench/corpus/schemastore.jsonl.gz] [--out bench-results/schemas.json]

Per schema: accepted by the spec loader (or refused, with the message), loaded as a user's schema file would be:
written to a folder next to the SchemaStore files its `$ref`s reach, and bundled with them by the loader; which backends build its grammar (as
batchjson configures them: relaxed grammar schema, no free whitespace) and in how long; what "auto" chooses.
Per labelled instance: whether the Validator agrees with the label; whether each backend's grammar lets the
instance through (compact JSON, keys in schema order): a valid instance refused is an over-constraint, an
invalid one (by the Validator) let through is a hole that only validation catches.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from batchjson.errors import SpecError
from batchjson.records import Generation, Prompt
from batchjson.schema.grammar import AUTO_ORDER, build, choose, grammar_accepts, relax
from batchjson.schema.validate import Validator
from batchjson.spec import SchemaSpec, load_schema

BACKENDS = ("guidance", "xgrammar")


def resolve(node, root):
    seen = 0
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#") and seen < 20:
        target = root
        for part in [p for p in node["$ref"][1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, dict) else None
        node, seen = target, seen + 1
    return node


def ordered(value, schema, root):
    """The instance with object keys in the schema's `properties` order, as a model decoding in order writes it."""
    schema = resolve(schema, root)
    if isinstance(value, dict):
        props = (schema or {}).get("properties") if isinstance(schema, dict) else None
        props = props if isinstance(props, dict) else {}
        keys = [k for k in props if k in value] + [k for k in value if k not in props]
        return {k: ordered(value[k], props.get(k), root) for k in keys}
    if isinstance(value, list):
        items = schema.get("items") if isinstance(schema, dict) else None
        return [ordered(v, items if isinstance(items, dict) else None, root) for v in value]
    return value


def load(row: dict, files: dict[str, dict], folder: Path) -> dict:
    """The row's schema through the spec loader, from a file laid out next to the files it refers to."""
    for name in row.get("refs", ()):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(files[name]))
    (folder / f"{row['name']}.json").write_text(json.dumps(row["schema"]))
    return load_schema(SchemaSpec(path=f"{row['name']}.json"), folder)


def measure(rows: list[dict], files: dict[str, dict]) -> dict:
    c: Counter = Counter()
    refused: Counter = Counter()
    build_s = {b: [] for b in BACKENDS}
    chosen: Counter = Counter()
    disagreements = []
    refusals = []
    for row in rows:
        c["schemas"] += 1
        try:
            with tempfile.TemporaryDirectory() as folder:
                schema = load(row, files, Path(folder))
            c["bundled"] += bool(row.get("refs")) and schema != row["schema"]
        except SpecError as e:
            refused[str(e).split(":")[0][:60]] += 1
            refusals.append((row["name"], str(e)[:300]))
            continue
        c["accepted"] += 1
        relaxed = {}
        for b in BACKENDS:
            r = relax(schema, b)
            t = time.perf_counter()
            try:
                build(r)
                relaxed[b] = r
                c[f"builds_{b}"] += 1
            except Exception:
                pass
            build_s[b].append(time.perf_counter() - t)
        choice = choose(schema)
        chosen[choice.backend or "none"] += 1
        c["usable"] += bool(choice.backend)
        validator = Validator(schema)
        for label in ("valid", "invalid"):
            for instance in row[label]:
                text = json.dumps(ordered(instance, schema, schema), separators=(",", ":"), ensure_ascii=False)
                ok = validator.check(Generation(Prompt("r", "u", ""), text, "stop")).ok
                c[f"{label}_instances"] += 1
                agree = ok == (label == "valid")
                c[f"{label}_agree"] += agree
                if not agree:
                    disagreements.append((row["name"], label))
                for b, r in relaxed.items():
                    try:
                        passes = grammar_accepts(r, text)
                    except Exception:
                        continue
                    if ok:
                        c[f"{b}_valid_checked"] += 1
                        c[f"{b}_blocked_valid"] += not passes
                    else:
                        c[f"{b}_invalid_checked"] += 1
                        c[f"{b}_holes"] += passes
                if choice.backend in relaxed:
                    c["chosen_valid_checked" if ok else "chosen_invalid_checked"] += 1
                    passes = grammar_accepts(relaxed[choice.backend], text)
                    c["chosen_blocked_valid" if ok else "chosen_holes"] += (not passes) if ok else passes
    return {"counts": dict(c), "refused": dict(refused), "refusals": refusals, "chosen": dict(chosen), "disagreements": disagreements,
            "build_ms": {b: {"median": round(statistics.median(v) * 1000, 2), "max": round(max(v) * 1000, 1)}
                         for b, v in build_s.items() if v}}


def report(r: dict) -> str:
    c = r["counts"]

    def pct(a, b):
        return f"{c.get(a, 0)}/{c.get(b, 0)} = {100 * c.get(a, 0) / max(c.get(b, 1), 1):.1f}%"

    lines = ["| measure | result |", "| --- | --- |",
             f"| spec acceptance | {pct('accepted', 'schemas')} (refused: {r['refused'] or 'none'}) |",
             f"| usable backend (auto) among accepted | {pct('usable', 'accepted')}; auto chose {r['chosen']} |"]
    for b in BACKENDS:
        lines.append(f"| {b} builds | {pct(f'builds_{b}', 'accepted')}; build median {r['build_ms'][b]['median']} ms, "
                     f"max {r['build_ms'][b]['max']} ms |")
    lines += [f"| validator agrees, valid instances | {pct('valid_agree', 'valid_instances')} |",
              f"| validator agrees, invalid instances | {pct('invalid_agree', 'invalid_instances')} |"]
    for b in BACKENDS + ("chosen",):
        lines.append(f"| {b}: valid answers blocked (over-constraint) | {pct(f'{b}_blocked_valid', f'{b}_valid_checked')} |")
        lines.append(f"| {b}: invalid answers let through (holes) | {pct(f'{b}_holes', f'{b}_invalid_checked')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench schemas", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=str(Path(__file__).parent / "corpus" / "schemastore.jsonl.gz"))
    ap.add_argument("--out", default="bench-results/schemas.json")
    ap.add_argument("--limit", type=int, default=None, help="the first N schemas only")
    a = ap.parse_args(argv)
    lines = [json.loads(line) for line in gzip.open(a.corpus, "rt")]
    files = {line["file"]: line["schema"] for line in lines if "file" in line}
    result = measure([line for line in lines if "name" in line][:a.limit], files)
    result["auto_order"] = AUTO_ORDER
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(report(result))
    print("validator disagreements:", result["disagreements"][:20])
    print(f"bundled: {result['counts'].get('bundled', 0)} schemas; refused:")
    for name, why in result["refusals"]:
        print(f"  {name}: {why}")
    return 0
