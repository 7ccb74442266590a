#!/usr/bin/env bash
# The main job: the default matrix (harness/default_matrix.toml) at every world size in NPROC_LIST,
# gloo on CPU and nccl where GPUs are (BACKENDS overrides), merged into one table and one JUnit file
# under results/. Installs the project and the CPU builds of DeepSpeed, torchtitan and megatron-core
# into .venv on first use. Extra flags go to `python -m harness
# matrix`, e.g. --targets reference, --matrix my.toml, --scenario xorl_ep_lora, --out DIR.
# Exits non-zero when any case fails (the default matrix includes known-bad clip functions).
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/python ]; then
  .ci/make-venv test  # torch==2.13.0 (CPU; TORCH_SPEC overrides), the project, the frameworks
fi
NPROC_LIST="${NPROC_LIST:-1 2 4 8}"
args=(--nproc-list "${NPROC_LIST// /,}")
if [ -n "${BACKENDS:-}" ]; then args+=(--backends "${BACKENDS// /,}"); fi
exec .venv/bin/python -m harness matrix "${args[@]}" "$@"
