#!/usr/bin/env bash
# Run 18, call 3 (defaults now: fwd unmasked, even, lv_lazy): the route kernel's unmasked tiles and the fused
# forward's launch settings again without masks, A/B in one process; the routing GPU tests at the new defaults.
C=call3
source results/bench/call_lib.sh
V="|route.unmasked=1|fwd.num_stages=3;fwd.maxnreg=128|fwd.bm_infer=128|fwd.maxnreg=0;fwd.num_stages=0"
step 150 ab_var $py scripts/bench/ab_scan.py --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph --reps 20 --variants "$V"
step 60 ab_var_b16 $py scripts/bench/ab_scan.py --points 65536:128 --batch 16 --rho 0 --timing cuda_graph --reps 20 --variants "$V"
step 200 t_routing $py -m pytest -q tests/test_triton_routing.py -m gpu
finish
