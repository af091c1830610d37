#!/usr/bin/env bash
# The distributed tests (the files that run process groups through tests/dist_utils.py) over NCCL, one rank per GPU
# (LONGATTN_DIST_BACKEND=nccl; world sizes above the GPU count skip; tests that count CPU allocations or stand FA4 in
# on the CPU stay on gloo). Each test spawns its ranks afresh (seconds of start-up each), so the ids are dealt
# round-robin over PROCS concurrent pytest processes whose ranks share the GPUs.
#
#   bash scripts/test_nccl.sh                          # every distributed test file
#   bash scripts/test_nccl.sh tests/test_ring.py       # some files
#   PROCS=3 LOGS=/tmp/nccl-tests bash scripts/test_nccl.sh
#
# Each process writes LOGS/ncclN.log and LOGS/ncclN.xml (JUnit); the exit status is non-zero when the collection
# fails, nothing is collected, or any test failed or a process did not finish.
set -uo pipefail
cd "$(dirname "$0")/.."
files=("$@")
[ ${#files[@]} -gt 0 ] || mapfile -t files < <(grep -l "^from dist_utils import\|^import dist_utils" tests/test_*.py)
count=$(python -c "import torch; print(torch.cuda.device_count())") || exit 1
[ "$count" -ge 2 ] || { echo "torch sees $count CUDA device(s): the NCCL tests need 2 or more" >&2; exit 1; }
procs=${PROCS:-4}
logs=${LOGS:-$(mktemp -d)}
mkdir -p "$logs" && rm -f "$logs"/nccl*.log "$logs"/nccl*.xml "$logs"/ids*.txt
export LONGATTN_DIST_BACKEND=nccl NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
python -m pytest -q --co -p no:cacheprovider -m "not gpu" "${files[@]}" > "$logs/collect.txt" 2>&1 || {
  echo "collection failed:" >&2; tail -20 "$logs/collect.txt" >&2; exit 1; }
grep "::" "$logs/collect.txt" > "$logs/ids.txt"
total=$(wc -l < "$logs/ids.txt")
[ "$total" -gt 0 ] || { echo "no test collected from ${files[*]}" >&2; exit 1; }
echo "$total tests over $procs processes, $count GPUs; logs in $logs"
SECONDS=0
. scripts/shards.sh
shard_env() { :; }
run_shards "$procs" nccl; rc=$?
grep -h -E "^(FAILED|ERROR) " "$logs"/nccl*.log
echo "took $SECONDS s"
exit $rc
