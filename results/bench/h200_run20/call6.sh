#!/usr/bin/env bash
# Run 20, call 6: bench_op.py's 256K point with MiTA timed after dense attention (the default order) and before it,
# in two processes: does the order move MiTA's time (the gap to ab_scan.py)?
C=call6
source results/bench/call_lib.sh
step 100 op_dense_first $py scripts/bench/bench_op.py --out "$O/dense_first" --points N262144 --backends triton --dense-long cudnn --dense-reps-long 2 --graph
step 70 op_mita_first $py scripts/bench/bench_op.py --out "$O/mita_first" --points N262144 --backends triton --dense-long cudnn --dense-reps-long 2 --graph --order mita-first
finish
