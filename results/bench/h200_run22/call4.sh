#!/usr/bin/env bash
# Run 22, call 4 (the new defaults: route_stream 3, tops_eq, persistent routing at 64K, lazy 2, lv_lazy 2, fb_final,
# final selection by a sort for lists of <= 256): the op benchmark (CUDA graphs, three points in one process), GPU
# tests of the top-k paths and of the whole op against naive_mita, Figure F at 64K-256K.
C=call4
source results/bench/call_lib.sh
export PYTHONUNBUFFERED=1
step 150 op_bench_graph $py scripts/bench/bench_op.py --out "$O" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2 --graph
step 230 t_gpu $py -m pytest -q tests/test_triton_routing.py tests/test_triton_mita.py -m gpu -k "select_kernel or persistent_fallback or tops_eq or (gpu_matches_naive and (65536 or 4097))"
step 150 figf_fused $py scripts/bench/bench_figf.py --out "$O" --compile --fused-mlp --min-n 65536 --max-n 262144 --dense cudnn --time-budget-s 100 --compile-start-tokens 1048576
finish
