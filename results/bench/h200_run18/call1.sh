#!/usr/bin/env bash
# Run 18, call 1: the lazy online softmax of the fused forward (FWD_CONFIG lazy) and of the block-top pass's
# landmark values (SCAN_CONFIG lv_lazy), the block-top pass without masks (even): GPU tests, then A/B against the
# defaults in one process (ab_scan.py --variants), with 128-landmark scan tiles at 8 warps as one more variant.
C=call1
source results/bench/call_lib.sh
step 90 t_lazy $py -m pytest -q tests/test_triton_mita.py -m gpu -k "lazy"
step 50 t_lv $py -m pytest -q tests/test_triton_routing.py -m gpu -k "with_landmark_values"
V="|fwd.unmasked=1|fwd.lazy=1;fwd.unmasked=1|even=1|even=1;lv_lazy=1|fwd.lazy=1;fwd.unmasked=1;even=1;lv_lazy=1|bs=128;num_warps=8"
step 230 ab_var $py scripts/bench/ab_scan.py --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph --reps 20 --variants "$V"
step 90 ab_var_b16 $py scripts/bench/ab_scan.py --points 65536:128 --batch 16 --rho 0 --timing cuda_graph --reps 20 --variants "$V"
step 80 ab_top $py scripts/bench/ab_scan.py --points 65536:128,262144:256 --rho 0 --timing cuda_graph --reps 20 --sweep emit_top=None,2,3 --sweep block_top=None,1,2
finish
