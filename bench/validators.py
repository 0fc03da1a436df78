"""What validation costs per row on the sample schema: batchjson's Validator.check against other JSON Schema
validators (those importable here), on the fake engine's canned outputs. Evidence for the runner's per-row budget.

    pip install --target /tmp/valbench fastjsonschema jsonschema-rs   # optional candidates, outside the venv
    PYTHONPATH=/tmp/valbench .venv/bin/python -m bench validators
"""

from __future__ import annotations

import argparse
import json
import time

import orjson

from bench.common import ROOT, table
from bench.overhead import SCHEMA_BAD, VALID

# Values each validator must judge alike: the canned outputs plus edge cases of the schema's bounds.
CASES = [(orjson.loads(v), True) for v in VALID] + [
    (orjson.loads(SCHEMA_BAD), False),
    ({**orjson.loads(VALID[1]), "items": [{"description": "x", "quantity": 0, "unit_price": 1}]}, False),
    ({**orjson.loads(VALID[1]), "extra": 1}, False),
    ({**orjson.loads(VALID[1]), "items": orjson.loads(VALID[0])["items"] * 2}, False),
]


def per_call(fn, arg, n=3000) -> float:
    t = time.process_time()
    for _ in range(n):
        fn(arg)
    return round(1e6 * (time.process_time() - t) / n, 2)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m bench validators", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    from jsonschema import validators

    from batchjson.records import Generation, Prompt
    from batchjson.schema.validate import Validator

    schema = json.loads((ROOT / "sample_data" / "schema.json").read_text())
    v = Validator(schema)
    cls = validators.validator_for(schema)
    plain = cls(schema)
    candidates = {"jsonschema is_valid (no format checker)": plain.is_valid}
    try:
        import fastjsonschema

        schema7 = {k: val for k, val in schema.items() if k != "$schema"}  # it knows drafts 4, 6 and 7 only
        compiled = fastjsonschema.compile(schema7)

        def fjs(x):
            try:
                compiled(x)
                return True
            except fastjsonschema.JsonSchemaException:
                return False

        candidates["fastjsonschema (compiled, draft-07)"] = fjs
    except ImportError:
        pass
    try:
        import jsonschema_rs

        candidates["jsonschema-rs is_valid"] = jsonschema_rs.validator_for(schema).is_valid
    except ImportError:
        pass
    p = Prompt("r", "u", "t")
    rows = [{"validator": "batchjson Validator.check (orjson + jsonschema + best_match)",
             "valid_us": per_call(lambda s: v.check(Generation(p, s, "stop")), VALID[0]),
             "invalid_us": per_call(lambda s: v.check(Generation(p, s, "stop")), SCHEMA_BAD),
             "agrees": all(v.check(Generation(p, orjson.dumps(x).decode(), "stop")).ok == ok for x, ok in CASES)}]
    value, bad = orjson.loads(VALID[0]), orjson.loads(SCHEMA_BAD)
    for name, fn in candidates.items():
        rows.append({"validator": name, "valid_us": per_call(fn, value), "invalid_us": per_call(fn, bad),
                     "agrees": all(bool(fn(x)) == ok for x, ok in CASES)})
    print(table(rows, [("validator", "validator"), ("valid_us", "us per valid row"),
                       ("invalid_us", "us per invalid row"), ("agrees", "same verdicts on the test cases")]))
    return 0 if all(r["agrees"] for r in rows) else 1
