#!/usr/bin/env bash
# Run 23, call 4 (the run-22 kernels, unchanged since 6592df4): the GPU tests that had not run with those defaults:
# the select kernel against the three-kernel path up to 1M, and the whole op against naive_mita at 4097 and 65536.
C=call4
source results/bench/call_lib.sh
export PYTHONUNBUFFERED=1
step 220 t_select $py -m pytest -q tests/test_triton_routing.py -m gpu -k "select_kernel"
step 240 t_naive $py -m pytest -q tests/test_triton_mita.py -m gpu -k "gpu_matches_naive and (65536 or 4097)"
finish
