#!/usr/bin/env bash
# Run 23, call 1: the 1D pooling kernel's settings (more bytes in flight per program), programmatic dependent launch
# of the forward's kernels once more (launch.PDL_CONFIG, off by default), and an Nsight Compute profile of the 64K
# forward at the run-22 defaults with per-line (Python source) counters of the kernels.
C=call1
source results/bench/call_lib.sh
export PYTHONUNBUFFERED=1
$py -c "import triton.language.extra.cuda as c, torch; from mita.ops.mita import launch; print('gdc', hasattr(c, 'gdc_wait'), 'pdl_supported', launch.pdl_supported(torch.device('cuda')))" >> "$O/env.txt" 2>&1
cat "$O/env.txt"
step 45 pool $py scripts/bench/pool_bench.py --points 65536:128,262144:256 --variants "|BL=256;num_warps=8|BL=256;num_warps=16|BL=512;num_warps=16|BL=512;num_warps=8|BL=64;num_warps=4|"
step 90 ab_pdl $py scripts/bench/ab_scan.py --points 65536:128,262144:256 --rho 0 --timing cuda_graph --reps 20 --variants "|pdl.enabled=1||pdl.enabled=1"
step 200 ncu64k ncu --clock-control none --profile-from-start off --set full --import-source yes -o "$O/fwd64k" $py scripts/bench/ncu_forward.py --n 65536
if [ -f "$O/fwd64k.ncu-rep" ]; then
  step 45 ncu64k_details ncu --import "$O/fwd64k.ncu-rep" --page details --csv
  step 80 ncu64k_cuda ncu --import "$O/fwd64k.ncu-rep" --page source --csv --print-source cuda
  step 80 ncu64k_source ncu --import "$O/fwd64k.ncu-rep" --page source --csv --print-source sass
  gzip -f "$O/ncu64k_source.log" "$O/ncu64k_cuda.log"
  rm -f "$O/fwd64k.ncu-rep"
fi
finish
