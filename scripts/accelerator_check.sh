#!/usr/bin/env bash
# One command for a GPU or TPU machine: install jax for the accelerator, run the gpu/tpu-marked
# tests and the benchmark there, and write a JSON report. (The multidevice tests run on CPU
# subprocesses wherever the default suite runs; they are not repeated here.)
#
#   bash scripts/accelerator_check.sh [OUT_DIR]          (default: accelerator_report/)
#
# JAX_ACCELERATOR_EXTRA overrides the jax extra to install (default: cuda12 when nvidia-smi
# exists, tpu when a TPU is visible, none otherwise).
# SPECDEC_OFFLINE=1: a machine without network whose jax already sees the accelerator: install
# nothing but this package (--no-deps) and bench BENCH_MODEL (default smollm2-135m; offline use
# smollm2-135m-random, the same shapes with random weights) with BENCH_DRAFTER (default ngram;
# oracle gives drafts that random weights accept) on the built-in prompts when Spec-Bench is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-accelerator_report}
mkdir -p "$out"
PYTHON=${PYTHON:-python}

if [[ "${SPECDEC_OFFLINE:-0}" == 1 ]]; then
  $PYTHON -m pip install -q --no-deps --no-build-isolation -e . || export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  extra=${JAX_ACCELERATOR_EXTRA:-}
  if [[ -z "$extra" ]]; then
    if command -v nvidia-smi >/dev/null; then extra=cuda12; elif [[ -e /dev/accel0 || -e /dev/vfio ]]; then extra=tpu; fi
  fi
  $PYTHON -m pip install -q -e ".[dev]"
  if [[ -n "$extra" ]]; then $PYTHON -m pip install -q -U "jax[$extra]"; fi
fi
$PYTHON -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$out/devices.txt"

spec_bench=${SPEC_BENCH:-../shared/data/spec_bench/question.jsonl}
prompts=()
if [[ -f "$spec_bench" ]]; then prompts=(--prompts-file "$spec_bench" --per-category 2); fi
set +e
$PYTHON -m pytest -n 0 -m "gpu or tpu" -rs --junitxml="$out/tests.xml" | tee "$out/tests.txt"
tests_rc=${PIPESTATUS[0]}
$PYTHON -m specdec_jax.cli bench --model "${BENCH_MODEL:-smollm2-135m}" --drafter "${BENCH_DRAFTER:-ngram}" \
  "${prompts[@]}" --repeats 3 --gamma 4 --json "$out/bench.json" | tee "$out/bench.md"
bench_rc=${PIPESTATUS[0]}
set -e

$PYTHON - "$out" "$tests_rc" "$bench_rc" <<'PY'
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
