#!/usr/bin/env bash
# Run 15, call 1: register caps and per-row kernel warps (launch settings added in 5d4b031), side by side on the same
# inputs (ab_scan.py, several --sweep, CUDA-graph replays) at 64K, 256K, 1M and Figure F's 64K x 16 layer; the
# start kernel's contiguous one-plane loads and int32 bisection against 161b067's kernels (a copy of the tree with
# the old files, default settings); the routing GPU tests on the new start kernel.
# The two baseline files were 161b067's kernel files, written beside this script before the call
# (git show 161b067:mita/ops/mita/triton_routing.py and .../triton_mita.py) and removed from the tree afterwards;
# to run this again, write them there first.
C=call1
source results/bench/call_lib.sh
B=/tmp/base; rm -rf $B; mkdir -p $B; cp -r mita scripts $B/
cp results/bench/h200_run15/baseline/triton_routing_161b067.py $B/mita/ops/mita/triton_routing.py
cp results/bench/h200_run15/baseline/triton_mita_161b067.py $B/mita/ops/mita/triton_mita.py
pts="--points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph"
sw="--sweep fwd.maxnreg=None,128,96 --sweep maxnreg=None,96,80 --sweep final_maxnreg=None,128,96 --sweep start_warps=None,4,16 --sweep lv.maxnreg=None,80"
step 200 ab_caps $py scripts/bench/ab_scan.py $pts $sw
step 90 ab_caps_b16 $py scripts/bench/ab_scan.py --points 65536:128 --batch 16 --rho 0 --timing cuda_graph $sw
step 60 ab_base bash -c "cd $B && PYTHONPATH=$B $py scripts/bench/ab_scan.py $pts --sweep num_warps=4"
step 45 ab_base_b16 bash -c "cd $B && PYTHONPATH=$B $py scripts/bench/ab_scan.py --points 65536:128 --batch 16 --rho 0 --timing cuda_graph --sweep num_warps=4"
step 70 ab_fwd_st2 $py scripts/bench/ab_scan.py --points 65536:128,1048576:512 --rho 0 --timing cuda_graph --set "fwd.num_stages=2" --sweep fwd.maxnreg=None,96,80
step 40 ab_fwd_st2_b16 $py scripts/bench/ab_scan.py --points 65536:128 --batch 16 --rho 0 --timing cuda_graph --set "fwd.num_stages=2" --sweep fwd.maxnreg=None,96,80
step 120 t_routing $py -m pytest -q tests/test_triton_routing.py -k gpu -p no:cacheprovider
echo "== done $(date -u +%T)"
