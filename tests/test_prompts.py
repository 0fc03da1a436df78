"""Rows -> prompts: a messages column rendered through the model's chat template, row by row."""

from __future__ import annotations

import pyarrow as pa

from batchjson.prompts import Renderer, chat_messages
from batchjson.source import Unit, UnitRef
from batchjson.spec import PromptSpec

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])


def unit(messages: list) -> Unit:
    ids = [f"r{i}" for i in range(len(messages))]
    batch = pa.table({"id": ids, "messages": pa.array(messages, pa.list_(MESSAGE))})
    return Unit(UnitRef("u", "in.parquet", "t", 0, 0, len(ids), 0), batch)


def test_messages_render_through_the_chat_template_and_bad_rows_are_data(tiny_model):
    chat = chat_messages(tiny_model)
    renderer = Renderer(PromptSpec(messages="messages"), ("", ""), "id", (), chat=chat)
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "{}"}, {"role": "user", "content": "Again"}]
    out = list(renderer.render(unit([turns, [], None, [{"role": "user", "content": None}]])))
    assert out[0].text == chat(turns) and out[0].text.index("Be brief.") < out[0].text.index("Again")
    assert [(g.error, g.prompt.row_id) for g in out[1:]] == [("empty_prompt", "r1"), ("empty_prompt", "r2"),
                                                             ("invalid_input", "r3")]
    assert "message 0 is not a {role, content} pair" in out[3].detail
