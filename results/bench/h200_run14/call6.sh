#!/usr/bin/env bash
# Run 14, call 6: the overflow flag raised from each count + emit program's end-of-program counter read (no per-step
# bookkeeping), against the kernels before the flag (2e94da4's triton_routing.py, shipped beside this script) in
# the same call: ab_scan.py (one value of num_warps, i.e. the defaults) in a copy of the tree holding the old file,
# then in this tree. Then the GPU fallback tests, the op benchmark (CUDA graph) and Figure F at 64K.
set -u
export PYTHONPATH=$PWD
O=$OUT/call6; mkdir -p "$O"
py=python
step() { local t=$1 name=$2; shift 2; echo "== $name ($(date -u +%T))"; timeout "$t" "$@" > "$O/$name.log" 2>&1; echo "rc $? $name"; tail -3 "$O/$name.log"; }
B=/tmp/base; rm -rf $B; mkdir -p $B; cp -r mita scripts $B/; cp results/bench/h200_run14/baseline/triton_routing_2e94da4.py $B/mita/ops/mita/triton_routing.py
pts="--points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph --sweep num_warps=4"
step 80 ab_base bash -c "cd $B && PYTHONPATH=$B $py scripts/bench/ab_scan.py $pts"
step 80 ab_new $py scripts/bench/ab_scan.py $pts
step 40 ab_base_b16 bash -c "cd $B && PYTHONPATH=$B $py scripts/bench/ab_scan.py --points 65536:128 --batch 16 --rho 0 --timing cuda_graph --sweep num_warps=4"
step 40 ab_new_b16 $py scripts/bench/ab_scan.py --points 65536:128 --batch 16 --rho 0 --timing cuda_graph --sweep num_warps=4
step 70 t_fallback $py -m pytest -q tests/test_triton_routing.py -k "gpu and (correlated or fallback)" -p no:cacheprovider
step 90 op_bench_graph $py scripts/bench/bench_op.py --out "$O" --points N65536,N262144,N1048576 --backends triton --dense-long cudnn --dense-reps-long 2 --graph
echo "== done $(date -u +%T)"
