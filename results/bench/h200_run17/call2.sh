#!/usr/bin/env bash
# Run 17, call 2 (tree of 1D Triton pooling + fused landmark values): GPU tests of both; per-kernel profile of the
# op points; the chunked plan's offsets and chunking settings; the op benchmark (CUDA graph) against cuDNN.
C=call2
source results/bench/call_lib.sh
step 90 t_new $py -m pytest -q tests/test_triton_routing.py tests/test_triton_mita.py -m gpu -k "landmark_values or pool"
step 80 kprof $py scripts/bench/kernel_profile.py --points N65536,N262144,N1048576
for s in _PLAN_EXPERTS=32 _PLAN_EXPERTS=16 _PLAN_EXPERTS=8 _PLAN_PROGRAMS=512 _PLAN_PROGRAMS=1024 _PLAN_ROWS=256; do
  step 40 "plan_$s" $py scripts/bench/plan_bench.py --points 2:65536:128,2:262144:256,2:1048576:512,32:65536:128 --dists uniform --kernels --set "$s"
done
step 120 op_bench_graph $py scripts/bench/bench_op.py --out "$O" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2 --graph
finish
