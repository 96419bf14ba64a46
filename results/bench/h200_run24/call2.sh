#!/usr/bin/env bash
# Run 24, call 2 (run-22 kernels): the op benchmark with each CUDA-graph replay queued behind a spin kernel
# (--queued: the GPU's execution time, without the graph's launch latency) at 64K, 256K, 1M; the same 64K point
# with replays launched onto an idle GPU (the earlier runs' method) in a second process; the timing mode's GPU test.
C=call2
source results/bench/call_lib.sh
export PYTHONUNBUFFERED=1
step 330 op_queued $py scripts/bench/bench_op.py --out "$O/queued" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2 --graph --queued
step 90 op_idle $py scripts/bench/bench_op.py --out "$O/idle" --points N65536 --backends triton --dense-long cudnn --graph
step 60 gputest $py -m pytest -q -m gpu tests/test_cuda_graph.py -k "queued or capture_failure"
finish
