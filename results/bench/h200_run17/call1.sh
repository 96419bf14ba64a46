#!/usr/bin/env bash
# Run 17, call 1: landmark values from the top-k's block-top pass (SCAN_CONFIG lv_fused, daecc97). GPU tests of the
# fused pass and of the whole op against naive_mita, then A/B of lv_fused 0 / 1 (forward, CUDA graphs) at the op
# points and Figure F's 64K x 16 layer, the fused pass's register cap and its chunk cap (lv_div).
C=call1
source results/bench/call_lib.sh
step 100 t_lv $py -m pytest -q -x tests/test_triton_routing.py -m gpu -k landmark_values
step 150 t_mita $py -m pytest -q tests/test_triton_mita.py -m gpu -k "gpu_matches_naive"
step 120 ab_lv $py scripts/bench/ab_scan.py --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph --reps 20 --sweep lv_fused=0,1 --sweep maxnreg=None,168,128 --set lv_fused=1
step 60 ab_lv_b16 $py scripts/bench/ab_scan.py --batch 16 --points 65536:128 --rho 0 --timing cuda_graph --reps 20 --sweep lv_fused=0,1 --sweep lv_div=8,4,16 --set lv_fused=1
step 60 ab_lv_div $py scripts/bench/ab_scan.py --points 65536:128,262144:256 --rho 0 --timing cuda_graph --reps 20 --sweep lv_div=8,4,2,16 --set lv_fused=1
finish
