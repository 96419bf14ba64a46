#!/usr/bin/env bash
# Run 13, call 5: the GPU tests of the fused op (every gpu-marked test of test_triton_mita.py) and the routing tests
# that call 2 did not select (CPU-sized cases run on the GPU), on the final kernels.
set -u
export PYTHONPATH=$PWD
O=$OUT/call5; mkdir -p "$O"
timeout 230 python -m pytest -q tests/test_triton_mita.py -m gpu > "$O/t_mita_gpu.log" 2>&1; echo "rc $? t_mita_gpu"; tail -3 "$O/t_mita_gpu.log"
timeout 110 python -m pytest -q tests/test_triton_routing.py -k "not gpu and not sparse" > "$O/t_routing_rest.log" 2>&1; echo "rc $? t_routing_rest"; tail -3 "$O/t_routing_rest.log"
