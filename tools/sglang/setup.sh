#!/usr/bin/env bash
# Builds .venv-sglang: a virtualenv of its own for a real SGLang server (SGLang pins its own
# torch and transformers, so never the project's .venv). Run by `make sglang`; see
# docs/engines.md.
#   - a machine with an NVIDIA GPU (nvidia-smi answers): SGLang as published, with its own deps;
#   - a CPU-only machine: the local CPU torch, then SGLang with --no-deps and its non-CUDA
#     requirements from tools/sglang/requirements-cpu.txt (pinned), and the launcher adds
#     tools/sglang/cpu_path (a stand-in for sgl_kernel's unpublished CPU build) at start-up.
# Idempotent: the stamp file says what was installed; a changed version or pin list rebuilds.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
VENV=${SGLANG_VENV:-.venv-sglang}
SGLANG_VERSION=0.5.23
TORCH_CPU_VERSION=2.13.0
REQS=tools/sglang/requirements-cpu.txt

if [ -n "${SGLANG_FLAVOUR:-}" ]; then flavour=$SGLANG_FLAVOUR
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=cuda
else flavour=cpu; fi

want="sglang==$SGLANG_VERSION torch==$TORCH_CPU_VERSION $flavour $(sha256sum < "$REQS" | cut -c1-16)"
if [ -f "$VENV/.installed" ] && [ "$(cat "$VENV/.installed")" = "$want" ]; then
  echo "$VENV: up to date ($want)"; exit 0
fi
rm -rf "$VENV"
"$PY" -m venv "$VENV"
pip=("$VENV/bin/pip" install --quiet)
"${pip[@]}" --upgrade pip
if [ "$flavour" = cuda ]; then
  "${pip[@]}" "sglang==$SGLANG_VERSION"
else
  # the CPU torch first, named again on every later install so that nothing replaces it
  "${pip[@]}" "torch==$TORCH_CPU_VERSION"
  "${pip[@]}" --no-deps "sglang==$SGLANG_VERSION" "compressed-tensors==0.18.0"
  "${pip[@]}" "torch==$TORCH_CPU_VERSION" -r "$REQS"
  "$VENV/bin/python" -c "import torch; assert not torch.version.cuda, torch.version.cuda"
fi
echo "$flavour" > "$VENV/rlpilot-flavour"
echo "$want" > "$VENV/.installed"
echo "$VENV: installed ($want)"
