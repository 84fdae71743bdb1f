#!/usr/bin/env bash
# Runtime tests and benchmarks on the GPU machine. Needs the pulp wheel in .whl/
# (carried: the GPU machine has no package index). Results go to $OUT.
set -uo pipefail
source experiments/_gpu_setup.sh
python3 -m pytest -q -x tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
python3 experiments/bench_runtime.py --out "$OUT/runtime" 2>&1 | grep -v "^I1" | tail -40
python3 experiments/figure2_hlo_profiles.py --backend gpu --out "$OUT/figure2_gpu" 2>&1 | grep "^|"
