#!/usr/bin/env bash
# Run 16, call 5: the torch.compile GPU tests after the custom op's fix (train without a default; call 4 found two
# failures), then Figure F at 64K with PyTorch's modules and with the fused MLP (its shipped defaults) in one call,
# both compiled. Only the log archive comes back.
C=call5
source results/bench/call_lib.sh
step 170 t_op_graph $py -m pytest -q tests/test_triton_op.py tests/test_cuda_graph.py -p no:cacheprovider
mkdir -p "$O/mod" "$O/fused"
step 75 figf64k_modules $py scripts/bench/bench_figf.py --out "$O/mod" --compile --min-n 65536 --max-n 65536 --dense cudnn --time-budget-s 60 --compile-start-tokens 1048576
step 75 figf64k_fused $py scripts/bench/bench_figf.py --out "$O/fused" --compile --fused-mlp --min-n 65536 --max-n 65536 --dense cudnn --time-budget-s 60 --compile-start-tokens 1048576
finish
