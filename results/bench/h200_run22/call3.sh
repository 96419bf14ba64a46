#!/usr/bin/env bash
# Run 22, call 3: on top of call 2's best (route_stream 3, tops_eq, the persistent routing kernel at 64K, the fused
# attention's FMA softmax): the fallback-row top-k inside the fallback kernel (fb_final), fewer fallback programs,
# 128-row query tiles for the inference forward, the landmark values' FMA softmax (lv_lazy 2), the final selection by
# a sort (final_narrow 2); GPU tests of the new options.
C=call3
source results/bench/call_lib.sh
export PYTHONUNBUFFERED=1
step 300 ab_more $py scripts/bench/ab_scan.py --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph --reps 20 --set "fwd.route_stream=3;tops_eq=1;route.persistent=2;fwd.lazy=2" --variants "|fb_final=1|fb_programs=32|fwd.bm_infer=128|lv_lazy=2|final_narrow=2|final_narrow=2;fb_final=1;lv_lazy=2"
step 240 t_new $py -m pytest -q -x tests/test_triton_routing.py tests/test_triton_mita.py -m gpu -k "tops_eq or lazy_softmax"
finish
