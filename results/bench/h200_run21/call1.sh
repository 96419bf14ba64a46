#!/usr/bin/env bash
# Run 21, call 1: what in a process slows the 256K MiTA forward after the 64K point (order_probe.py); per-kernel
# GPU time of the forward at 64K and 256K (kernel_profile.py).
C=call1
source results/bench/call_lib.sh
export PYTHONUNBUFFERED=1
step 300 probe $py scripts/bench/order_probe.py --steps "mita:262144,mita:262144,point:65536,mita:262144,mita:262144,empty,mita:262144,sleep:10,mita:262144,mita:65536,mita:262144,fwdbwd:65536,mita:262144,dense:65536,mita:262144,keep:512,mita:262144"
step 150 kprof $py scripts/bench/kernel_profile.py --points N65536,N262144
finish
