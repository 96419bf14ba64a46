#!/usr/bin/env bash
# Run 15, call 5: GPU tests on the shipped defaults (fused forward capped at 96 registers with 2 stages; final top-k
# kernel capped; the start kernel's one-plane loads): every GPU test of the MiTA kernels' module, then the routing
# module's GPU tests. Only the log archive comes back.
C=call5
source results/bench/call_lib.sh
step 230 t_mita_gpu $py -m pytest -q tests/test_triton_mita.py -m gpu -p no:cacheprovider
step 110 t_routing_gpu $py -m pytest -q tests/test_triton_routing.py tests/test_triton_op.py tests/test_cuda_graph.py -k gpu -p no:cacheprovider
echo "== done $(date -u +%T)"
