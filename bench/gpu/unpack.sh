#!/bin/bash
# On the GPU host, from the project root: move the files this transfer brought in .dev/ to /tmp/chunks, and on
# the last transfer ("final") unpack them: Python packages to /tmp/site (vLLM and its needs, then the
# arctic-inference wheel), the SmolLM2 model to /tmp/models/smollm2.
set -e
mkdir -p /tmp/chunks
for f in .dev/part?? .dev/smol?? .dev/arctic_inference-*.whl; do [ -f "$f" ] && mv "$f" /tmp/chunks/; done
ls /tmp/chunks
if [ "$1" = "final" ]; then
  cat /tmp/chunks/part?? | xz -d | tar -x -C /tmp
  for whl in /tmp/chunks/arctic_inference-*.whl; do
    [ -f "$whl" ] && python3 -m pip install -q --no-deps --no-index --no-compile --upgrade --target /tmp/site "$whl"
  done
  # Fail here, not at the first suffix engine start, if the extension does not load on this Python.
  if [ -d /tmp/site/arctic_inference ]; then
    PYTHONPATH=/tmp/site python3 -c "from arctic_inference.suffix_decoding import SuffixDecodingCache as C; C(); print('suffix decoding ok')"
  fi
  if [ -f /tmp/chunks/smol00 ]; then
    mkdir -p /tmp/smol && cat /tmp/chunks/smol?? | tar -x -C /tmp/smol
    PYTHONPATH=/tmp/site python3 "$(dirname "$0")/convert_gguf.py" /tmp/smol SmolLM2-135M-Instruct.Q4_1.gguf /tmp/models/smollm2
  fi
fi
