#!/usr/bin/env bash
# Run 15, call 3: the fused forward with 32-key blocks (FWD_CONFIG bn_max = 32: 94 registers, 5 programs per SM
# uncapped; 6-7 with a cap of 80 / 72 and 2 stages) against 64-key blocks with caps of 112 / 104 / 96 and 2 stages,
# at 64K, 256K, 1M and 64K x 16. Only the log archive comes back (the machine returns at most 8 files).
C=call3
source results/bench/call_lib.sh
pts="--points 65536:128,262144:256,1048576:512 --rho 0 --timing cuda_graph"
b16="--points 65536:128 --batch 16 --rho 0 --timing cuda_graph"
for p in pts b16; do
    step 100 ab_bn32_$p $py scripts/bench/ab_scan.py ${!p} --set "fwd.bn_max=32" --sweep fwd.maxnreg=None,80
    step 100 ab_bn32_st2_$p $py scripts/bench/ab_scan.py ${!p} --set "fwd.bn_max=32;fwd.num_stages=2" --sweep fwd.maxnreg=None,80,72
    step 100 ab_bn64_st2_$p $py scripts/bench/ab_scan.py ${!p} --set "fwd.num_stages=2" --sweep fwd.maxnreg=112,104,96
done
echo "== done $(date -u +%T)"
