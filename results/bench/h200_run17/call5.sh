#!/usr/bin/env bash
# Run 17, call 5: the routing GPU tests call 4 did not reach (its step's limit): the atomic / fallback emission
# paths and correlated tokens with the sorted final kernel, and exact_topk(lv=...).
C=call5
source results/bench/call_lib.sh
step 110 t_fallback $py -m pytest -q tests/test_triton_routing.py -m gpu -k "fallback_paths or correlated"
step 60 t_lv $py -m pytest -q tests/test_triton_routing.py -m gpu -k "with_landmark_values"
finish
