#!/usr/bin/env bash
# The GPU path in one script, for a machine with one or more NVIDIA GPUs:
#   1. `nvidia-smi` sees the GPUs and torch agrees (torch.cuda.device_count());
#   2. the default matrix on nccl (`clipcheck matrix --backends nccl`) at every world size of
#      1, 2, 4, 8 up to the GPU count (larger worlds are planned as skips, never run), JUnit, JSON Lines
#      and report.html under results-gpu/;
#   3. the GPU decisions of the pytest suite (tests/test_devices.py), the plugin tests on the GPU
#      machine (tests/test_plugin.py: nccl skips, xdist's CUDA_VISIBLE_DEVICES split) and the nccl
#      failure path (tests/test_gpu.py, 2+ GPUs: a raise, a skipped collective, a kernel left in
#      flight, a dead rank; each fails its own case and the next case passes);
#   4. harness.audit on nccl (docs/audit.md): tests/audit_jobs/toy.py under torchrun, one rank per GPU
#      (up to 4), gradients on the GPUs: the correct clip must PASS (restore=True: gradients given back
#      bit for bit), and at 2+ GPUs the rank-local clip must FAIL;
# then one summary line. Expected to take under 8 minutes on one GPU.
# Usage: bench/gpu_check.sh [PYTHON]   (default .venv/bin/python)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"
OUT=results-gpu
mkdir -p "$OUT"
START=$SECONDS

gpus="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
if [ "${gpus:-0}" -lt 1 ]; then
  echo "gpu_check: no CUDA device visible to torch ($("$PY" -c 'import torch; print(torch.__version__)')); nothing checked"
  exit 2
fi
worlds=""
for w in 1 2 4 8; do [ "$w" -le "$gpus" ] && worlds="${worlds:+$worlds,}$w"; done

"$PY" -m harness matrix --backends nccl --nproc-list "$worlds" --out "$OUT" >"$OUT/matrix.out" 2>&1
matrix_rc=$?
"$PY" -m pytest -q -p no:cacheprovider tests/test_devices.py tests/test_plugin.py tests/test_gpu.py --junitxml "$OUT/pytest-junit.xml" \
  >"$OUT/pytest.out" 2>&1
pytest_rc=$?

audit_world=$(( gpus < 4 ? gpus : 4 ))
audit_verdicts=""
audit_ok=1
for mode in correct local; do
  "$PY" -m torch.distributed.run --standalone --nproc_per_node="$audit_world" tests/audit_jobs/toy.py "$mode" \
    "$OUT/audit-$mode.json" restore cuda >"$OUT/audit-$mode.out" 2>&1
  got="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["verdict"])' "$OUT/audit-$mode.json" 2>/dev/null)"
  want=PASS
  [ "$mode" = local ] && [ "$audit_world" -gt 1 ] && want=FAIL
  [ "$got" = "$want" ] || audit_ok=0
  audit_verdicts="${audit_verdicts:+$audit_verdicts, }$mode ${got:-none} (want $want)"
done

summary="$(grep -E '^matrix:' "$OUT/matrix.out" | tail -1)"
tests="$(tail -1 "$OUT/pytest.out")"
# the default matrix holds known-bad targets: exit 1 (failures found) is the expected outcome; 2 or 3
# (bad input, a rank hung or died, a case not judged) is a broken GPU path
verdict=ok
[ "$matrix_rc" -le 1 ] || verdict=BROKEN
[ "$pytest_rc" -eq 0 ] || verdict=BROKEN
[ "$audit_ok" -eq 1 ] || verdict=BROKEN
echo "gpu_check: $verdict: $gpus GPU(s), worlds $worlds on nccl; ${summary:-no matrix summary} (exit $matrix_rc);" \
     "tests: $tests; audit at world $audit_world on nccl: $audit_verdicts; $((SECONDS - START)) s"
[ "$verdict" = ok ]
