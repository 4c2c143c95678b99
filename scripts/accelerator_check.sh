#!/usr/bin/env bash
# One command for a GPU or TPU machine: install jax for the accelerator, run the gpu/tpu-marked
# tests and the benchmark there, and write a JSON report. (The multidevice tests run on CPU
# subprocesses wherever the default suite runs; they are not repeated here.)
#
#   bash scripts/accelerator_check.sh [OUT_DIR]          (default: accelerator_report/)
#
# JAX_ACCELERATOR_EXTRA overrides the jax extra to install (default: cuda12 when nvidia-smi
# exists, tpu when a TPU is visible, none otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-accelerator_report}
mkdir -p "$out"

extra=${JAX_ACCELERATOR_EXTRA:-}
if [[ -z "$extra" ]]; then
  if command -v nvidia-smi >/dev/null; then extra=cuda12; elif [[ -e /dev/accel0 || -e /dev/vfio ]]; then extra=tpu; fi
fi
pip install -q -e ".[dev]"
if [[ -n "$extra" ]]; then pip install -q -U "jax[$extra]"; fi
python -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$out/devices.txt"

set +e
python -m pytest -m "gpu or tpu" -rs --junitxml="$out/tests.xml" | tee "$out/tests.txt"
tests_rc=${PIPESTATUS[0]}
specdec-jax bench --prompts-file "${SPEC_BENCH:-../shared/data/spec_bench/question.jsonl}" --per-category 2 \
  --repeats 3 --gamma 4 --json "$out/bench.json" | tee "$out/bench.md"
bench_rc=${PIPESTATUS[0]}
set -e

python - "$out" "$tests_rc" "$bench_rc" <<'PY'
import json, pathlib, sys
import jax
out, tests_rc, bench_rc = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
bench = json.loads((out / "bench.json").read_text()) if (out / "bench.json").exists() else None
report = {
    "jax": jax.__version__,
    "devices": [str(d) for d in jax.devices()],
    "tests_exit_code": tests_rc,  # 5 = no test selected (no accelerator visible)
    "bench_exit_code": bench_rc,
    "bench_overall": bench and bench["overall"],
}
(out / "report.json").write_text(json.dumps(report, indent=1))
print(json.dumps(report, indent=1))
PY
[[ "$tests_rc" == 0 || "$tests_rc" == 5 ]] && [[ "$bench_rc" == 0 ]]
