#!/bin/bash
# On the GPU host, from the project root: move the files this transfer brought in .dev/ to /tmp/chunks, and on
# the last transfer ("final") unpack them: Python packages to /tmp/site (vLLM and its needs, then the
# arctic-inference wheel), the models to /tmp/models (smollm2; coder-0.5b and coder-1.5b once all their chunks came).
#   bash .dev/unpack.sh            move what came
#   bash .dev/unpack.sh final      ... then unpack and convert whatever is complete
#   bash .dev/unpack.sh q05|q15    ... then only that Qwen model (reassembled, checked, converted)
#   bash .dev/unpack.sh site|smol  ... then only the packages, or only SmolLM2
#   bash .dev/unpack.sh torch      ... then torch 2.14.0 and triton 3.8.0 into the packages (build_bundle.sh TORCH=1)
set -e
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p /tmp/chunks
for f in .dev/part?? .dev/smol?? .dev/q15_?? .dev/q05_?? .dev/t214_?? .dev/arctic_inference-*.whl .dev/py_spy-*.whl; do
  [ -f "$f" ] && mv "$f" /tmp/chunks/
done
du -sh /tmp/chunks; ls /tmp/chunks | tr '\n' ' '; echo
convert() {  # qwen model: q05 -> coder-0.5b.gguf -> /tmp/models/coder-0.5b
  local stem=$1 name=$2
  mkdir -p /tmp/gguf
  cat /tmp/chunks/${stem}_?? > /tmp/gguf/$name.gguf
  (cd /tmp/gguf && grep " $name.gguf" "$here/qwen.sha256" | sha256sum -c -)
  rm -f /tmp/chunks/${stem}_??
  PYTHONPATH=/tmp/site:$PWD python3 "$here/convert_gguf.py" /tmp/gguf $name.gguf /tmp/models/$name
}
site() {
  cat /tmp/chunks/part?? | xz -d | tar -x -C /tmp
  for whl in /tmp/chunks/arctic_inference-*.whl; do
    [ -f "$whl" ] && python3 -m pip install -q --no-deps --no-index --no-compile --upgrade --target /tmp/site "$whl"
  done
  # py-spy (bench grammar --pyspy samples the engine process's stacks), where the transfer brought its wheel
  for whl in /tmp/chunks/py_spy-*.whl; do
    [ -f "$whl" ] && python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/spy "$whl"
  done
  # Fail here, not at the first suffix engine start, if the extension does not load on this Python.
  if [ -d /tmp/site/arctic_inference ]; then
    PYTHONPATH=/tmp/site python3 -c "from arctic_inference.suffix_decoding import SuffixDecodingCache as C; C(); print('suffix decoding ok')"
  fi
}
smol() {
  mkdir -p /tmp/smol && cat /tmp/chunks/smol?? | tar -x -C /tmp/smol
  PYTHONPATH=/tmp/site python3 "$here/convert_gguf.py" /tmp/smol SmolLM2-135M-Instruct.Q4_1.gguf /tmp/models/smollm2
}
torch214() {  # vLLM 0.34's own torch (2.14.0) and triton (3.8.0), over the host's, where 0.34 does not load on it
  mkdir -p /tmp/twhl && cat /tmp/chunks/t214_?? | tar -x -C /tmp/twhl
  python3 -m pip install -q --no-deps --no-index --no-compile --upgrade --target /tmp/site /tmp/twhl/*.whl
  PYTHONPATH=/tmp/site python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"
}
case "${1:-}" in
  site) site ;;
  torch) torch214 ;;
  smol) smol ;;
  q05) convert q05 coder-0.5b ;;
  q15) convert q15 coder-1.5b ;;
  final)
    site
    [ -f /tmp/chunks/smol00 ] && smol
    [ -f /tmp/chunks/q05_00 ] && convert q05 coder-0.5b
    [ -f /tmp/chunks/q15_00 ] && convert q15 coder-1.5b
    ;;
esac
