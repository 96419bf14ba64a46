#!/usr/bin/env bash
# Run 18, call 4 (defaults now also: the route kernel's unmasked tiles): the routing kernel on a second stream
# (FWD_CONFIG route_stream), its GPU test and A/B; the op benchmark (CUDA graphs) at the defaults and with it.
C=call4
source results/bench/call_lib.sh
step 60 t_stream $py -m pytest -q tests/test_triton_mita.py -m gpu -k "route_stream"
step 100 ab_stream $py scripts/bench/ab_scan.py --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph --reps 20 --sweep fwd.route_stream=0,1,0,1
step 50 ab_stream_b16 $py scripts/bench/ab_scan.py --points 65536:128 --batch 16 --rho 0 --timing cuda_graph --reps 20 --sweep fwd.route_stream=0,1,0,1
mkdir -p "$O/a" "$O/b"
step 130 op_bench_graph $py scripts/bench/bench_op.py --out "$O/a" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2 --graph
step 130 op_bench_graph_stream $py scripts/bench/bench_op.py --out "$O/b" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2 --graph --set "fwd.route_stream=1"
finish
