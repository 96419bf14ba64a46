# Sourced by the device-call scripts (results/bench/h200_runN/callM.sh): the environment and one helper.
# Needs C, the call's name (logs go to $OUT/$C). step SECONDS NAME CMD...: runs CMD with a time limit, its output in
# $OUT/$C/NAME.log; prints the exit status and the log's last lines.
set -u
export PYTHONPATH=$PWD
O=$OUT/$C
mkdir -p "$O"
py=python
step() {
    local t=$1 name=$2
    shift 2
    echo "== $name ($(date -u +%T))"
    timeout "$t" "$@" > "$O/$name.log" 2>&1
    echo "rc $? $name"
    tail -3 "$O/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > "$O/env.txt" 2>&1
$py -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$O/env.txt" 2>&1
# finish: pack this call's logs into $OUT/$C.tgz and drop the folder (a call brings back at most 8 files).
finish() {
    echo "== done $(date -u +%T)"
    tar czf "$OUT/$C.tgz" -C "$OUT" "$C" && rm -rf "${OUT:?}/$C"
}
