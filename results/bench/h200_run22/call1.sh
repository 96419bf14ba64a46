#!/usr/bin/env bash
# Run 22, call 1: is Nsight Compute usable here (hardware counters of the 64K forward's kernels: stall reasons,
# issue rates, per-instruction samples)? The routing on a second stream after the block-top pass (route_stream 2 / 3)
# against in order, and its GPU tests.
C=call1
source results/bench/call_lib.sh
export PYTHONUNBUFFERED=1
(which ncu; ncu --version) > "$O/ncu_version.txt" 2>&1
cat "$O/ncu_version.txt"
step 200 ncu64k ncu --clock-control none --profile-from-start off --set full --import-source yes -o "$O/fwd64k" $py scripts/bench/ncu_forward.py --n 65536
if [ -f "$O/fwd64k.ncu-rep" ]; then
  step 60 ncu64k_details ncu --import "$O/fwd64k.ncu-rep" --page details --csv
  step 60 ncu64k_raw ncu --import "$O/fwd64k.ncu-rep" --page raw --csv
  step 90 ncu64k_source ncu --import "$O/fwd64k.ncu-rep" --page source --csv --print-source sass
  ls -la "$O"
  rm -f "$O/fwd64k.ncu-rep"
fi
step 150 ab_stream $py scripts/bench/ab_scan.py --points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph --reps 20 --sweep fwd.route_stream=0,2,3,1
step 120 t_stream $py -m pytest -q tests/test_triton_mita.py -m gpu -k "route_stream"
finish
