#!/usr/bin/env bash
# Two GPUs, predictions from measured layer shares: VGG16 (batch 128, M = 1..16,
# GPipe and 1F1B) and the transformer (batch 256, M = 2, 4, 8, 1F1B), with each
# layer timed alone on gpu:0 (`cost_table(measure=True)`) instead of the spec
# sheets' roofline, and the fixed part from gradient-only steps.
set -uo pipefail
source experiments/_gpu_setup.sh
bash experiments/gpu_two_gpus_sweep.sh vgg16 128 1,2,4,8,16 220 two_gpus_vgg16_b128_measured \
  --measure_layers
bash experiments/gpu_two_gpus_sweep.sh transformer 256 2,4,8 170 \
  two_gpus_transformer_b256_measured --measure_layers --schedules 1f1b
