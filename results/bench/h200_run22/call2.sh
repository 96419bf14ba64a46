#!/usr/bin/env bash
# Run 22, call 2: the new options side by side (CUDA graphs, one process, route_stream 3 throughout): block tops by
# maximum + first equal key (tops_eq), the persistent routing kernel, the fused attention's FMA softmax (lazy 2),
# the block-top pass's pipelining depth and register cap; GPU tests of tops_eq and lazy 2.
C=call2
source results/bench/call_lib.sh
export PYTHONUNBUFFERED=1
step 100 t_new $py -m pytest -q tests/test_triton_routing.py tests/test_triton_mita.py -m gpu -k "tops_eq or lazy_softmax"
step 330 ab_new $py scripts/bench/ab_scan.py --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph --reps 20 --set "fwd.route_stream=3" --variants "|tops_eq=1|route.persistent=1|route.persistent=2|fwd.lazy=2|stages=2|tops_eq=1;stages=2;maxnreg=168;lv_div=4|tops_eq=1;route.persistent=2;fwd.lazy=2"
finish
