#!/usr/bin/env bash
# Profile the devices of the GPU machine: `hetpar profile` (full sizes) plus a
# summary table. Run from the repository root on the GPU machine; results go
# to $OUT (profiles_gpu.json, profile_gpu.log). Budget: under ~4 minutes.
#
#   OUT=/some/dir bash experiments/gpu_profile.sh
set -euo pipefail
OUT="${OUT:-experiments/results}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."

# Setup as in DEVICE.md; pulp is not needed for profiling, so its wheel is optional.
W=$(ls -d ../shared/wheels shared/wheels 2>/dev/null | head -1 || true)
if [ -n "$W" ]; then
  python3 -m pip install -q --no-index --find-links "$W" pulp || echo "pulp not installed (not needed here)"
fi
python3 -m pip install -q --no-build-isolation --no-deps -e .

{
  echo "== card"
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv || true
  lscpu | grep -E "Model name|^CPU\(s\)" || true
  python3 -c "import jax; print('jax', jax.__version__, jax.devices(), jax.devices('cpu')); print([d.device_kind for d in jax.devices()])"
  echo "== hetpar profile"
  start=$(date +%s)
  python3 -m hetpar profile --out "$OUT/profiles_gpu.json"
  echo "profile took $(( $(date +%s) - start )) s"
  echo "== what the predictor says with these profiles (f32, 4096^3 matmul and 256 MB elementwise)"
  python3 - "$OUT/profiles_gpu.json" <<'PY'
import sys
from hetpar.cost_models import LayerWork, load_profiles, predict
ps = load_profiles(sys.argv[1])
mm = LayerWork({"matmul": 2 * 4096**3}, {"matmul": 3 * 4096**2 * 4})
ew = LayerWork({"elementwise": 2 * 2**26}, {"elementwise": 2 * 2**28})
for name in [n for n, p in ps.devices.items() if p.origin == "measured"] + ["h100", "h200", "a100", "cpu"]:
    p = ps.device(name)
    print(f"{name:8s} {p.origin:11s} matmul {predict(p, mm) * 1e3:8.3f} ms   elementwise {predict(p, ew) * 1e3:8.3f} ms")
for lk in ps.links:
    print(f"{lk.src} -> {lk.dst} {lk.path:20s} 256 MB in {lk.time(2**28) * 1e3:8.2f} ms")
PY
  if python3 -c "import pytest" 2>/dev/null; then
    echo "== cost-model tests"
    python3 -m pytest -q -p no:cacheprovider tests/test_cost_models.py || true
  fi
} 2>&1 | tee "$OUT/profile_gpu.log"
