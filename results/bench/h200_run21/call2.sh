#!/usr/bin/env bash
# Run 21, call 2: the forward's kernels in launch order at 64K and 256K (kernel_profile.py --sequence); the block-top
# pass's grid (lv_div: key chunks; bs: landmarks per tile; warps) and the routing kernel's query tile at 64K / 256K.
C=call2
source results/bench/call_lib.sh
export PYTHONUNBUFFERED=1
step 150 kprof $py scripts/bench/kernel_profile.py --points N65536,N262144 --sequence
step 400 ab $py scripts/bench/ab_scan.py --points 65536:128,262144:256 --rho 0 --timing cuda_graph --reps 20 --variants "|lv_div=4|lv_div=2|bs=32|bs=32;lv_div=4|bs=128|num_warps=8|route.bm=64|"
finish
