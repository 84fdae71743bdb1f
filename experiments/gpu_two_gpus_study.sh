#!/usr/bin/env bash
# Two GPUs: the local model-parallelism study's models, VGG16 and AlexNet at
# 224x224, pipelined over both GPUs for M = 1..16 under GPipe and 1F1B,
# against one GPU's jax.jit and data parallelism.
set -uo pipefail
source experiments/_gpu_setup.sh
bash experiments/gpu_two_gpus_sweep.sh vgg16 128 1,2,4,8,16 260 two_gpus_vgg16_b128
bash experiments/gpu_two_gpus_sweep.sh alexnet 512 1,2,4,8,16 130 two_gpus_alexnet_b512
