"""Rows -> prompts: a messages column rendered through the model's chat template, row by row."""

from __future__ import annotations

import pyarrow as pa
import pytest

from batchjson.engine.fake import FakeEngines
from batchjson.job import run_job
from batchjson.prompts import Renderer, _tokenizer, chat_frame, chat_messages
from batchjson.source import Unit, UnitRef
from batchjson.spec import PromptSpec, load_spec
from helpers import write_job, write_rows

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


class EnginesWithATokenizer(FakeEngines):
    """Fake engines that hold the model's tokenizer, as a vLLM engine does once it has started."""

    def __init__(self, tokenizer, **kwargs):
        super().__init__(**kwargs)
        self.loaded = tokenizer

    def start(self, spec, decoding, speculative):
        engine = super().start(spec, decoding, speculative)
        engine.tokenizer = self.loaded
        return engine


def test_prompts_are_framed_with_the_engines_tokenizer_not_a_second_load(tmp_path, tiny_model, monkeypatch):
    """Loading the tokenizer again after the engine start delayed the first request by 1-4 s."""
    import transformers

    loaded = transformers.AutoTokenizer.from_pretrained(tiny_model)

    def no_second_load(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded again")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_second_load)
    write_rows(tmp_path / "in.parquet", 20)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet")
    report = run_job(load_spec(job), progress=False, engine_factory=EnginesWithATokenizer(loaded, valid=1.0))
    assert report.valid == 20 and report.verified["ok"]


@pytest.mark.engine
def test_the_vllm_engines_tokenizer_frames_prompts_as_the_model_files_do(tmp_path, tiny_model, engines):
    write_rows(tmp_path / "in.parquet", 4)
    spec = load_spec(write_job(tmp_path, tiny_model, tmp_path / "in.parquet"))
    engine = engines.start(spec, spec.sampling, spec.speculative)  # the engine a run of this spec starts
    try:
        assert chat_frame(tiny_model, "Be brief.", engine.tokenizer) == chat_frame(tiny_model, "Be brief.")
        assert _tokenizer(tiny_model, engine.tokenizer) is engine.tokenizer  # taken, not loaded again
    finally:
        engine.close()
