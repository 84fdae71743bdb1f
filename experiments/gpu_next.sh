#!/usr/bin/env bash
# GPU checks for issues 6 and 7. One-GPU machine (H200 host, to compare with run 3):
#   bash experiments/gpu_next.sh launch   # fixed cost per step under XLA flags; overhead probe
#   bash experiments/gpu_next.sh one      # overhead probe after the host-batch fix; VGG16 row
#   bash experiments/gpu_next.sh rows     # VGG16 baseline row; spec-latency baselines
# Needs the pulp wheel in .whl/ (carried). Results go to $OUT.
set -uo pipefail
source experiments/_gpu_setup.sh
cd experiments
case "${1:-launch}" in
launch)
  # How much of the transformer's step is fixed (kernel launches), with XLA's
  # CUDA-graph command buffers as they come, off, and on for every kind.
  for flags in "" "--xla_gpu_enable_command_buffer=" \
      "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1"; do
    XLA_FLAGS="$flags" timeout 130 python3 probe_launch.py --batches 16,64,256 \
      --out "$OUT/probe_launch.jsonl" 2>&1 | grep "^batch\|^fit\|Error"
  done
  # jit-first one-device path against jax.jit, interleaved (goal <= 1.03).
  timeout 150 python3 probe_overhead.py 2>&1 | grep -v "^I1\|^W1" | tee "$OUT/probe_overhead.txt"
  ;;
one)
  # The host-batch fix against jax.jit, interleaved (goal <= 1.03), then the VGG16 row.
  timeout 140 python3 probe_overhead.py 2>&1 | grep -v "^I1\|^W1" | tee "$OUT/probe_overhead.txt"
  timeout 330 python3 bench_baselines.py --out "$OUT/baselines_vgg16" --models vgg16 \
    --memory_model "" --profiles results/profile_gpu_h200.json 2>&1 | tail -3
  ;;
rows)
  # The missing VGG16 row, and lm_embed/cnn_preprocess under the new spec-sheet link
  # latency (no --profiles: what hetpar.auto sees by default).
  timeout 330 python3 bench_baselines.py --out "$OUT/baselines_vgg16" --models vgg16 \
    --memory_model "" --profiles results/profile_gpu_h200.json 2>&1 | tail -3
  timeout 150 python3 bench_baselines.py --out "$OUT/baselines_spec" \
    --models lm_embed,cnn_preprocess --memory_model "" 2>&1 | tail -3
  ;;
esac
