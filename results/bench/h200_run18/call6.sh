#!/usr/bin/env bash
# Run 18, call 6 (shipped defaults: + 1D pooling 128 rows per step at 8 warps): the op benchmark (CUDA graphs), then
# the GPU tests of the op that calls 1-5 did not run at these defaults, for the time left.
C=call6
source results/bench/call_lib.sh
step 85 op_bench_graph $py scripts/bench/bench_op.py --out "$O" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2 --graph
step 95 t_mita $py -m pytest -q tests/test_triton_mita.py -m gpu -k "gpu_lazy or pool or folded or shared_in_route or deterministic"
finish
