#!/usr/bin/env bash
# Run 21, call 3: the count + emit pass (23 us at 64K, 117 us at 256K in call 2): emit_top 3 (fewer blocks scored
# again) at 256K / 1M, emit_top 2 at 64K, and the blocks per step (emit_bb).
C=call3
source results/bench/call_lib.sh
export PYTHONUNBUFFERED=1
step 250 ab_long $py scripts/bench/ab_scan.py --points 262144:256,1048576:512 --rho 0 --timing cuda_graph --reps 20 --variants "|emit_top=3|emit_top=3;emit_bb=8|emit_bb=8|"
step 120 ab_64k $py scripts/bench/ab_scan.py --points 65536:128 --rho 0 --timing cuda_graph --reps 20 --variants "|emit_top=2|emit_bb=4|emit_bb=8|"
finish
