#!/usr/bin/env bash
# Run 18, call 5: the 1D pooling kernel's settings (unmasked loads now default) side by side; the op's GPU tests
# against naive_mita at the run's defaults; the per-kernel profile of the forward at 256K.
C=call5
source results/bench/call_lib.sh
step 60 pool $py scripts/bench/pool_bench.py
step 330 t_mita $py -m pytest -q tests/test_triton_mita.py -m gpu -k "gpu_strided or gpu_matches_naive or gpu_variants or route_stream"
step 60 kprof $py scripts/bench/kernel_profile.py --points N262144,N65536
finish
