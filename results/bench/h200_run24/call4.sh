#!/usr/bin/env bash
# Run 24, call 4 (run-22 kernels): the op benchmark at every point (DeiT-S layer, N = 1K ... 1M) with queued
# CUDA-graph replays (the GPU's execution time of one call), the table's source for this run.
C=call4
source results/bench/call_lib.sh
export PYTHONUNBUFFERED=1
step 420 op_all_queued $py scripts/bench/bench_op.py --out "$O" --backends triton --dense-long cudnn --dense-reps-long 2 --graph --queued
finish
