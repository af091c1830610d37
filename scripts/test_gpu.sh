#!/usr/bin/env bash
# The GPU tests (marker `gpu`: bf16 against float64, the speed paths; and every test of the FlashAttention-4 files,
# whose unmarked ones check the installed FA4's version and compile CuTe masks), spread over the visible GPUs: the
# tests' ids dealt round-robin, one pytest per GPU (each compiles the Triton and FA4 kernels its tests use, so the
# wall time falls with the GPU count; one GPU runs them one after another); then the tests marked `multigpu` in one
# pytest that sees every GPU (they skip where fewer GPUs than they need are visible).
#
#   bash scripts/test_gpu.sh                      # every test file
#   bash scripts/test_gpu.sh tests/test_fa4.py    # some files
#   GPUS=2 LOGS=/tmp/gpu-tests bash scripts/test_gpu.sh
#
# Each process writes LOGS/gpuN.log and LOGS/gpuN.xml (JUnit); the exit status is non-zero when the collection
# fails, nothing is collected, or any test failed or a process did not finish.
set -uo pipefail
cd "$(dirname "$0")/.."
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(tests/test_*.py)
# the GPUs this process may use (an existing CUDA_VISIBLE_DEVICES is kept: shard i runs on its i-th entry)
count=$(python -c "import torch; print(torch.cuda.device_count())") || exit 1
IFS=, read -r -a visible <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((count - 1)))}"
gpus=${GPUS:-$count}
if ! [[ "$gpus" =~ ^[0-9]+$ ]] || [ "$gpus" -lt 1 ] || [ "$gpus" -gt "$count" ]; then
  echo "GPUS=$gpus: torch sees $count CUDA device(s) here (the GPU tests skip without one)" >&2; exit 1
fi
logs=${LOGS:-$(mktemp -d)}
mkdir -p "$logs" && rm -f "$logs"/gpu*.log "$logs"/gpu*.xml "$logs"/ids*.txt
fa4=() other=()
for f in "${files[@]}"; do [[ "$f" == *fa4* ]] && fa4+=("$f") || other+=("$f"); done
# pytest's status 5 is "no test collected": a file whose GPU tests are all multi-GPU ones (run below)
collect() { python -m pytest -q --co -p no:cacheprovider "$@" > "$logs/collect.txt" 2>&1; local rc=$?
  [ $rc -eq 0 ] || [ $rc -eq 5 ] || {
  echo "collection failed (pytest --co $*):" >&2; tail -20 "$logs/collect.txt" >&2; exit 1; }
  grep "::" "$logs/collect.txt" >> "$logs/ids.txt"; }
touch "$logs/ids.txt"
[ ${#other[@]} -eq 0 ] || collect -m "gpu and not multigpu" "${other[@]}"
[ ${#fa4[@]} -eq 0 ] || collect -m "not multigpu" "${fa4[@]}"
total=$(wc -l < "$logs/ids.txt")
python -m pytest -q --co -p no:cacheprovider -m multigpu "${files[@]}" 2>/dev/null | grep "::" > "$logs/multi.txt"
[ "$total" -gt 0 ] || [ -s "$logs/multi.txt" ] || { echo "no test collected from ${files[*]}" >&2; exit 1; }
echo "$total tests over $gpus GPU(s); logs in $logs"
SECONDS=0 rc=0
. scripts/shards.sh
shard_env() { echo "CUDA_VISIBLE_DEVICES=${visible[$1]}"; }
[ "$total" -eq 0 ] || { run_shards "$gpus" gpu; rc=$?; }
# the multi-GPU tests last, on every GPU dealt above (their ranks take GPUs 0, 1, ... of those)
if [ -s "$logs/multi.txt" ]; then
  echo "$(wc -l < "$logs/multi.txt") multi-GPU tests on GPUs $(IFS=,; echo "${visible[*]:0:$gpus}")"
  CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${visible[*]:0:$gpus}") xargs -d '\n' -a "$logs/multi.txt" python -m pytest -q -rfEs \
    -p no:cacheprovider --durations=5 --junitxml="$logs/multigpu.xml" > "$logs/multigpu.log" 2>&1 || rc=1
  echo "multi-GPU: $(grep -E '(passed|failed|error|skipped)' "$logs/multigpu.log" | tail -1)"
fi
grep -h -E "^(FAILED|ERROR) " "$logs"/gpu*.log "$logs"/multigpu.log 2>/dev/null
echo "took $SECONDS s"
exit $rc
