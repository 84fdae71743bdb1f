#!/usr/bin/env bash
# Runtime tests and benchmarks on the GPU machine. Needs the pulp wheel in .whl/
# (carried: the GPU machine has no package index). Results go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --find-links .whl pulp
python3 -m pip install -q --no-build-isolation --no-deps -e .
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -q -x tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
python3 experiments/bench_runtime.py --out "$OUT/runtime" 2>&1 | grep -v "^I1" | tail -40
python3 experiments/figure2_hlo_profiles.py --backend gpu --out "$OUT/figure2_gpu" 2>&1 | grep "^|"
