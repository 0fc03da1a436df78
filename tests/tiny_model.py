"""Build a tiny, deterministic, randomly initialised Llama model + byte-level BPE tokenizer for tests."""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = (
    "the a an of to and in is it you that he was for on are with as his they be at one have this from "
    "name value id type title text label score count number true false null yes no city country color "
    "person user system assistant answer question json object array string integer row column data "
    "hello world item price total date email status result error ok red green blue alice bob paris"
).split()


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(2000):
        words = rng.sample(WORDS, 6)
        obj = {words[0]: words[1], words[2]: rng.randint(-999, 9999), words[3]: rng.random() < 0.5,
               words[4]: [rng.randint(0, 99), None, round(rng.uniform(-9, 9), 3)], words[5]: {"k": "v x"}}
        lines.append(json.dumps(obj) + json.dumps(obj, separators=(",", ":")))
        lines.append(" ".join(rng.choices(WORDS, k=12)).capitalize() + ". " + str(rng.randint(0, 10**6)))
        lines.append(f"<|im_start|>user\n{' '.join(words)}<|im_end|>\n<|im_start|>assistant\n")
    lines.append("0123456789 {}[]:,\"'\\ -+.eE")
    return lines


def _is_complete(out: Path) -> bool:
    return all((out / f).exists() for f in ("config.json", "tokenizer.json", "tokenizer_config.json"))


def make_tiny_model(out_dir: str | Path, *, vocab_size: int = 512, seed: int = 0) -> Path:
    """Create (once) a tiny random LlamaForCausalLM + tokenizer in `out_dir` and return its path."""
    out = Path(out_dir)
    if _is_complete(out):
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(_corpus(seed), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                  pad_token="<|pad|>", chat_template=CHAT_TEMPLATE)

    torch.manual_seed(seed)
    # head_dim=32: vLLM's CPU attention kernel rejects head_dim 16 (hidden 64 / 4 heads).
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, intermediate_size=128, max_position_embeddings=4096,
                         tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, torch_dtype="float32")
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    # Written beside, then renamed: the suite's parallel workers may make it at once, and none takes a half-written
    # one (the same seed gives the same model, so whichever rename lands first is kept).
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tiny-"))
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # made meanwhile by another process
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/tiny_model.py OUT_DIR")
    print(make_tiny_model(sys.argv[1]))
