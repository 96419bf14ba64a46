#!/usr/bin/env bash
# Run 16, call 1: the fused residual + MLP kernel (mita/ops/fused_mlp.py) on the GPU: its tests, its launch settings
# against PyTorch's modules (eager and compiled), Figure F with it in both models (64K..256K, compiled), and where the
# compiled MiTA model's forward goes with it (kernel_profile). Only the log archive comes back.
C=call1
source results/bench/call_lib.sh
step 80 t_mlp $py -m pytest -q tests/test_fused_mlp.py -p no:cacheprovider
step 110 mlp_bench $py scripts/bench/mlp_bench.py --rows 1048576,65536
step 175 figf_fused $py scripts/bench/bench_figf.py --out "$O" --compile --fused-mlp --min-n 65536 --max-n 262144 --dense cudnn --time-budget-s 140 --compile-start-tokens 1048576
step 100 prof_fused $py scripts/bench/kernel_profile.py --figf 65536:16 --compile --fused-mlp
step 90 t_strided $py -m pytest -q tests/test_triton_mita.py -m gpu -k strided -p no:cacheprovider
finish
