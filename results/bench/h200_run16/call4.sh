#!/usr/bin/env bash
# Run 16, call 4: GPU tests on the final kernels (fused MLP with its new defaults; routing, op and CUDA-graph GPU tests,
# of which run 15 reached 14 of 26), then register caps on the five backward launches (BWD_CONFIG, never timed)
# at Figure F's 64K x 16 layer and at 1M, forward + backward. Only the log archive comes back.
C=call4
source results/bench/call_lib.sh
step 45 t_mlp $py -m pytest -q tests/test_fused_mlp.py -p no:cacheprovider
step 220 t_route_op_graph $py -m pytest -q tests/test_triton_routing.py tests/test_triton_op.py tests/test_cuda_graph.py -k gpu -p no:cacheprovider
sw="--sweep bwd.dq_maxnreg=None,128,96 --sweep bwd.dkdv_maxnreg=None,128,96 --sweep bwd.final_maxnreg=None,128 --sweep bwd.shared_maxnreg=None,128 --sweep bwd.lv_dr_maxnreg=None,128"
step 130 ab_bwd_b16 $py scripts/bench/ab_scan.py --points 65536:128 --batch 16 --rho 0 --timing cuda_graph --backward $sw
step 150 ab_bwd_1m $py scripts/bench/ab_scan.py --points 1048576:512 --rho 0 --timing cuda_graph --backward $sw
finish
