#!/usr/bin/env bash
# Run 17, call 3: the op benchmark (CUDA graph) with the landmark values in their own pass (lv_fused=0) and from the
# block-top pass (default), one after the other on one machine (call 2 had 256K slower than run 15 although
# ab_scan.py had it faster); the scan passes at 8 warps (the fused block-top pass holds 240-254 registers at 4).
C=call3
source results/bench/call_lib.sh
mkdir -p "$O/a" "$O/b"
step 130 op_lv0 $py scripts/bench/bench_op.py --out "$O/a" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2 --graph --set "lv_fused=0"
step 130 op_lv1 $py scripts/bench/bench_op.py --out "$O/b" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2 --graph
step 80 ab_warps $py scripts/bench/ab_scan.py --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph --reps 20 --sweep num_warps=4,8
finish
