#!/usr/bin/env bash
# Run 21, call 5 (the shipped kernels: the per-row select kernel by default): GPU tests of the top-k paths (the select
# kernel against the three kernels, 64K-1M; the fallback paths; correlated tokens) and of the whole op against
# naive_mita; the op benchmark (CUDA graphs); Figure F at 64K-256K.
C=call5
source results/bench/call_lib.sh
export PYTHONUNBUFFERED=1
step 240 t_gpu $py -m pytest -q tests/test_triton_routing.py tests/test_triton_mita.py -m gpu -k "select_kernel or persistent_fallback or correlated or atomic_and_fallback or (gpu_matches_naive and (65536 or 4097))"
step 150 op_bench_graph $py scripts/bench/bench_op.py --out "$O" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2 --graph
step 150 figf_fused $py scripts/bench/bench_figf.py --out "$O" --compile --fused-mlp --min-n 65536 --max-n 262144 --dense cudnn --time-budget-s 110 --compile-start-tokens 1048576
finish
