#!/usr/bin/env bash
# The accelerator check, in at most about 5 minutes on one GPU or TPU with no network: the gpu/tpu-marked
# tests, then experiments/accelerator_check.py (random bfloat16 weights of the Qwen2.5-1.5B and Llama-3-8B
# shapes drawn on the device: plain decoding's step against the bandwidth floor, Tv(w)/T1, batches 1-64,
# rounds at gamma 1-8 and a 16-node tree with free-draft speedups, the loop's per-round overhead),
# one JSON and one table (docs/testing.md "On an accelerator").
#
#   bash scripts/accelerator_check.sh [OUT_DIR]          (default: accelerator_report/)
#
# Installs nothing when jax already sees an accelerator (the package itself from the working tree,
# without dependencies, if it is not installed); otherwise installs the dev extra and jax for the
# accelerator (JAX_ACCELERATOR_EXTRA, default cuda12 when nvidia-smi exists, tpu when a TPU is
# visible); with none, the check runs its tiny --dry-run shapes. CHECK_BUDGET_S (default 150): no measurement starts after this many seconds of the
# check; what did not fit is listed under "skipped". PYTHON: the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-accelerator_report}
mkdir -p "$out"
PYTHON=${PYTHON:-python}

sees_accelerator() { $PYTHON -c "import jax, sys; sys.exit(jax.devices()[0].platform == 'cpu')" 2>/dev/null; }
if sees_accelerator; then
  $PYTHON -c "import specdec_jax" 2>/dev/null \
    || $PYTHON -m pip install -q --no-deps --no-build-isolation -e . \
    || export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  extra=${JAX_ACCELERATOR_EXTRA:-}
  if [[ -z "$extra" ]]; then
    if command -v nvidia-smi >/dev/null; then extra=cuda12; elif [[ -e /dev/accel0 || -e /dev/vfio ]]; then extra=tpu; fi
  fi
  $PYTHON -m pip install -q -e ".[dev]"
  if [[ -n "$extra" ]]; then $PYTHON -m pip install -q -U "jax[$extra]"; fi
fi
$PYTHON -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$out/devices.txt"

set +e
timeout 120 $PYTHON -m pytest -p no:cacheprovider -n 0 -m "gpu or tpu" -rs --junitxml="$out/tests.xml" tests/test_accelerator.py \
  | tee "$out/tests.txt"
tests_rc=${PIPESTATUS[0]}
dry=(); sees_accelerator || dry=(--dry-run)  # no accelerator: tiny shapes, a check of the check
PYTHONPATH=experiments${PYTHONPATH:+:$PYTHONPATH} $PYTHON experiments/accelerator_check.py --out "$out" \
  --budget-s "${CHECK_BUDGET_S:-150}" "${dry[@]}"
check_rc=$?
set -e

$PYTHON - "$out" "$tests_rc" "$check_rc" <<'PY'
import json, pathlib, sys
out, tests_rc, check_rc = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
check = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else None
report = {"tests_exit_code": tests_rc,  # 5 = no test selected (no accelerator visible)
          "check_exit_code": check_rc, "check": check}
(out / "report.json").write_text(json.dumps(report, indent=1))
print(f"wrote {out}/report.json")
PY
[[ "$tests_rc" == 0 || "$tests_rc" == 5 ]] && [[ "$check_rc" == 0 ]]
