#!/usr/bin/env bash
# Run 21, call 6 (the last few device minutes): the fallback rows' top-k inside the persistent fallback kernel
# (fb_final 1, new default) -- GPU tests where most rows overflow (graph replays against the ten-launch fallback,
# which takes the final kernel) and the select-kernel tests; the forward with fb_final 1 / 0 side by side.
C=call6
source results/bench/call_lib.sh
export PYTHONUNBUFFERED=1
step 110 t_gpu $py -m pytest -q tests/test_triton_routing.py -m gpu -k "persistent_fallback or (select_kernel and 65536) or atomic_and_fallback"
step 50 ab $py scripts/bench/ab_scan.py --points 65536:128,262144:256 --rho 0 --timing cuda_graph --reps 20 --variants "|fb_final=0|"
finish
