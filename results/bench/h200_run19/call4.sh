#!/usr/bin/env bash
# Run 19, call 4 (shipped defaults, as call 3): the top-k GPU tests call 3's step limit cut (early-stopped start,
# correlated tokens) and the fused op against naive_mita at N = 4097 and 65536 (forward and backward, bf16).
C=call4
source results/bench/call_lib.sh
step 150 t_routing $py -m pytest -q tests/test_triton_routing.py -m gpu -k "start_steps or correlated"
step 100 t_mita $py -m pytest -q tests/test_triton_mita.py -m gpu -k "gpu_matches_naive and (65536 or 4097)"
finish
