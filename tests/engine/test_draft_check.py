"""A draft model must share the target's tokenizer and vocabulary: `check` and `run` refuse one that does not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchjson.cli import main
from batchjson.engine import check_draft
from batchjson.errors import SpecError
from helpers import write_job, write_rows


def _copy(model: str, folder: Path, vocab_size=None, rename=None) -> str:
    """A model folder like `model` (its config and tokenizer; check_draft reads no weights), with changes."""
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model) / name, folder / name)
    if vocab_size:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"vocab_size": vocab_size}))
    if rename:
        doc = json.loads((folder / "tokenizer.json").read_text())
        vocab = doc["model"]["vocab"]
        token = next(t for t in vocab if t.isalpha() and t + "x" not in vocab)
        vocab[token + "x"] = vocab.pop(token)  # the same size, one id means another token
        (folder / "tokenizer.json").write_text(json.dumps(doc))
    return str(folder)


def test_a_draft_of_the_same_tokenizer_is_accepted(tiny_model, tmp_path):
    check_draft(tiny_model, _copy(tiny_model, tmp_path / "draft"))


def test_a_draft_with_another_vocabulary_size_is_refused(tiny_model, tmp_path):
    size = json.loads((Path(tiny_model) / "config.json").read_text())["vocab_size"]
    with pytest.raises(SpecError, match=rf"speculative.draft_model: .* vocabulary of {size + 64} tokens"):
        check_draft(tiny_model, _copy(tiny_model, tmp_path / "draft", vocab_size=size + 64))


def test_a_draft_with_another_tokenizer_is_refused(tiny_model, tmp_path):
    with pytest.raises(SpecError, match="speculative.draft_model: .*tokenizer differs from the target's"):
        check_draft(tiny_model, _copy(tiny_model, tmp_path / "draft", rename=True))


def test_check_and_run_exit_2_naming_the_key(tiny_model, tmp_path):
    write_rows(tmp_path / "in.parquet", 3)
    draft = _copy(tiny_model, tmp_path / "draft", rename=True)
    job = write_job(tmp_path, tiny_model, tmp_path / "in.parquet", speculative="draft_model",
                    extra="")
    job.write_text(job.read_text().replace('method = "draft_model"',
                                           f'method = "draft_model"\ndraft_model = "{draft}"'))
    for command in ("check", "run"):
        result = CliRunner().invoke(main, [command, str(job)])
        assert result.exit_code == 2, result.output
        assert "speculative.draft_model" in result.output and "tokenizer differs" in result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.parquet"))
    ok = _copy(tiny_model, tmp_path / "same")
    job.write_text(job.read_text().replace(draft, ok))
    result = CliRunner().invoke(main, ["check", str(job)])
    assert result.exit_code == 0 and "the target's tokenizer and vocabulary" in result.output, result.output
