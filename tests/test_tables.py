"""Part files: typed columns where the schema maps cleanly to Arrow, atomic writes."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from batchjson.records import Generation, Outcome, Prompt
from batchjson.tables import PartSink

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                                           "score": {"type": "number"}, "tags": {"type": "array"}}}


def outcome(row_id, value):
    text = str(value).replace("'", '"')
    return Outcome(Generation(Prompt(row_id, "u", "prompt", {"source": "s"}), text, "stop", 3, 4), value=value)


def test_valid_rows_get_typed_columns_and_metadata(tmp_path):
    sink = PartSink("id", pa.schema([pa.field("source", pa.string())]), SCHEMA)
    table = sink.valid([outcome("a", {"name": "x", "n": 2, "score": 1, "tags": [1]}),
                        outcome("b", {"name": "y", "n": 2**70, "score": 0.5, "tags": []})], pass_no=2)
    assert table.column_names == ["id", "source", "json", "name", "n", "score",
                                  "_pass", "_finish_reason", "_prompt_tokens", "_output_tokens"]
    assert table.column("score").to_pylist() == [1.0, 0.5]
    assert table.column("n").to_pylist() == [None, None]  # beyond int64: the json column keeps the value
    assert table.column("_pass").to_pylist() == [2, 2]
    assert table.column("json").to_pylist()[1] == '{"name": "y", "n": 1180591620717411303424, "score": 0.5, "tags": []}'
    pq.write_table(table, tmp_path / "p.parquet")
    assert pq.read_table(tmp_path / "p.parquet").equals(table)


def test_requeue_rows_keep_their_prompt():
    sink = PartSink("id", pa.schema([pa.field("source", pa.string())]), SCHEMA)
    bad = Outcome(Generation(Prompt("a", "u", "the prompt", {"source": "s"}), "{", "length", 3, 4),
                  reason="truncated", detail="hit max_tokens")
    row = sink.rejected([bad], 1, with_prompt=True).to_pylist()[0]
    assert (row["prompt"], row["reason"], row["raw_text"]) == ("the prompt", "truncated", "{")


def test_non_object_root_gets_a_typed_value_column():
    import pyarrow as pa

    from batchjson.records import Generation, Outcome, Prompt
    from batchjson.tables import PartSink

    def outcome(value):
        import json as _json
        return Outcome(Generation(Prompt("r1", "u", "p"), _json.dumps(value), "stop", 1, 1), value=value)

    sink = PartSink("id", pa.schema([]), {"type": "array", "items": {"type": "string"}})
    table = sink.valid([outcome(["a", "b"]), outcome([])], 1)
    assert table.column("value").to_pylist() == [["a", "b"], []] and table.schema.field("value").type == pa.list_(pa.string())
    sink = PartSink("id", pa.schema([]), {"type": ["integer", "null"]})
    assert sink.valid([outcome(3), outcome(None)], 1).column("value").to_pylist() == [3, None]
    # No Arrow type fits an array of objects: the json column alone holds it.
    assert "value" not in PartSink("id", pa.schema([]), {"type": "array", "items": {"type": "object"}}).output_schema.names
    # A type list containing "object" is an object root: one column per property.
    assert "a" in PartSink("id", pa.schema([]), {"type": ["object", "null"],
                                                 "properties": {"a": {"type": "string"}}}).output_schema.names


def test_what_pydantic_writes_gets_typed_columns(tmp_path):
    """Refs to an enum, Optional fields (anyOf [X, null]) and a list of strings map to Arrow; a nested model stays
    in the json column."""
    from helpers import import_model, write_model

    schema = import_model(tmp_path, write_model(tmp_path)).model_json_schema()
    sink = PartSink("id", pa.schema([pa.field("source", pa.string())]), schema)
    assert sink.typed == {"name": pa.string(), "n": pa.int64(), "color": pa.string(), "note": pa.string(),
                          "tags": pa.list_(pa.string())}
    full = {"name": "ab", "n": 3, "color": "red", "place": {"city": "Oslo"}, "note": "hi", "tags": ["x", "y"]}
    bare = {"name": "cd", "n": 4, "color": "blue", "place": {"city": "Rome"}, "tags": []}
    table = sink.valid([outcome("a", full), outcome("b", bare)], pass_no=1)
    assert table.select(["color", "note", "tags"]).to_pylist() == [
        {"color": "red", "note": "hi", "tags": ["x", "y"]}, {"color": "blue", "note": None, "tags": []}]
    assert "place" not in table.column_names
