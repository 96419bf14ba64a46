#!/usr/bin/env bash
# Run 15, call 2: the fused attention forward's query tile for a forward without backward (FWD_CONFIG bm_infer) with
# register caps and pipeline stages; finer caps at 64-row tiles; the final top-k kernel's cap; the one-loop forward
# (FWD_CONFIG one_loop, when present); GPU tests of the new paths. ab_scan.py times forwards under no_grad, so
# bm_infer applies there.
C=call2
source results/bench/call_lib.sh
pts="--points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph"
b16="--points 65536:128 --batch 16 --rho 0 --timing cuda_graph"
big="--set fwd.bm_infer=128 --sweep fwd.maxnreg=None,168,128"
small="--sweep fwd.maxnreg=None,128,112 --sweep final_maxnreg=None,112,96,80"
step 120 ab_big $py scripts/bench/ab_scan.py $pts $big
step 50 ab_big_b16 $py scripts/bench/ab_scan.py $b16 $big
step 90 ab_big2 $py scripts/bench/ab_scan.py $pts --set "fwd.bm_infer=128;fwd.num_stages=2" --sweep fwd.maxnreg=168,128
step 40 ab_big2_b16 $py scripts/bench/ab_scan.py $b16 --set "fwd.bm_infer=128;fwd.num_stages=2" --sweep fwd.maxnreg=168,128
step 40 ab_small_b16 $py scripts/bench/ab_scan.py $b16 $small
step 40 ab_small2_b16 $py scripts/bench/ab_scan.py $b16 --set "fwd.num_stages=2" --sweep fwd.maxnreg=112,104,96
if python -c "from mita.ops.mita import triton_mita as t; assert 'one_loop' in t.FWD_CONFIG" 2>/dev/null; then
    step 90 ab_one_loop $py scripts/bench/ab_scan.py $pts --sweep fwd.one_loop=0,1
    step 40 ab_one_loop_b16 $py scripts/bench/ab_scan.py $b16 --sweep fwd.one_loop=0,1
    step 120 t_one_loop $py -m pytest -q tests/test_triton_mita.py -k "one_loop" -p no:cacheprovider
fi
step 90 t_infer $py -m pytest -q tests/test_triton_mita.py tests/test_triton_op.py -k "inference_plan or fake_shapes or gpu_matches_naive and 65536" -p no:cacheprovider
echo "== done $(date -u +%T)"
