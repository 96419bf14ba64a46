#!/usr/bin/env bash
# Run 19, call 1: programmatic dependent launch of the forward's kernels (launch.CONFIG pdl, opt-in) and the start
# threshold's early-stopped bisection (SCAN_CONFIG start_steps, default 32): GPU tests of both, then A/B of the
# forward (CUDA graphs, one process per point set) with each and both, i.i.d. and correlated tokens.
C=call1
source results/bench/call_lib.sh
step 150 t_pdl $py -m pytest -q tests/test_triton_routing.py tests/test_triton_mita.py -m gpu -k "pdl"
step 170 ab $py scripts/bench/ab_scan.py --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph --reps 20 --variants "|launch.pdl=1|start_steps=24|start_steps=20|launch.pdl=1;start_steps=20|"
step 60 ab_b16 $py scripts/bench/ab_scan.py --points 65536:128 --batch 16 --rho 0 --timing cuda_graph --reps 20 --variants "|launch.pdl=1|start_steps=20|launch.pdl=1;start_steps=20|"
step 80 ab_rho $py scripts/bench/ab_scan.py --points 65536:128,262144:256 --rho 0.9 --timing cuda_graph --reps 10 --variants "|start_steps=20|launch.pdl=1;start_steps=20"
step 60 t_launch $py -m pytest -q tests/test_launch.py -m gpu
finish
