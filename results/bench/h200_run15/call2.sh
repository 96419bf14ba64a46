#!/usr/bin/env bash
# Run 15, call 2: the one-loop fused forward (FWD_CONFIG one_loop) and its register caps; the forward's query tile
# for a forward without backward (FWD_CONFIG bm_infer = 128) with register caps; the final top-k kernel's cap at
# 64K x 16; GPU tests of the one-loop forward and of the inference plan. ab_scan.py times forwards under no_grad,
# so bm_infer applies there.
C=call2
source results/bench/call_lib.sh
pts="--points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph"
b16="--points 65536:128 --batch 16 --rho 0 --timing cuda_graph"
one="--sweep fwd.one_loop=0,1 --sweep fwd.maxnreg=None,128"
onecap="--set fwd.one_loop=1 --sweep fwd.maxnreg=None,128,112"
big="--set fwd.bm_infer=128 --sweep fwd.maxnreg=None,168,128 --sweep fwd.one_loop=0,1"
step 100 ab_one $py scripts/bench/ab_scan.py $pts $one
step 80 ab_onecap $py scripts/bench/ab_scan.py $pts $onecap
step 100 ab_big $py scripts/bench/ab_scan.py $pts $big
step 100 ab_b16 $py scripts/bench/ab_scan.py $b16 $one --sweep final_maxnreg=None,112,96
step 60 ab_b16_big $py scripts/bench/ab_scan.py $b16 $big
step 60 ab_b16_onecap $py scripts/bench/ab_scan.py $b16 $onecap
step 100 t_gpu $py -m pytest -q tests/test_triton_mita.py tests/test_triton_op.py -k "one_loop or inference_plan or fake_shapes" -p no:cacheprovider
echo "== done $(date -u +%T)"
