#!/usr/bin/env bash
# Run 18, call 2: call 1's A/B again after the fix of the unmasked forward without the lazy softmax (call 1 stopped
# at its first compile), and the 1M cases of the landmark-value GPU test that call 1's step limit cut.
C=call2
source results/bench/call_lib.sh
V="|fwd.unmasked=1|fwd.lazy=1;fwd.unmasked=1|even=1|even=1;lv_lazy=1|fwd.lazy=1;fwd.unmasked=1;even=1;lv_lazy=1|bs=128;num_warps=8"
step 230 ab_var $py scripts/bench/ab_scan.py --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph --reps 20 --variants "$V"
step 90 ab_var_b16 $py scripts/bench/ab_scan.py --points 65536:128 --batch 16 --rho 0 --timing cuda_graph --reps 20 --variants "$V"
step 70 t_lv $py -m pytest -q tests/test_triton_routing.py -m gpu -k "with_landmark_values and 1048576"
finish
