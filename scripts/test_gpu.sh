#!/usr/bin/env bash
# The GPU tests (marker `gpu`: bf16 against float64, the speed paths, FlashAttention-4 where it is installed),
# spread over the visible GPUs: the tests' ids dealt round-robin, one pytest per GPU (each compiles the Triton and
# FA4 kernels its tests use, so the wall time falls with the GPU count; one GPU runs them one after another).
#
#   bash scripts/test_gpu.sh                      # every GPU test file
#   bash scripts/test_gpu.sh tests/test_fa4.py    # some files
#   GPUS=2 LOGS=/tmp/gpu-tests bash scripts/test_gpu.sh
#
# Each process writes LOGS/gpuN.log and LOGS/gpuN.xml (JUnit); the exit status is non-zero when any test failed or
# a process did not finish.
set -uo pipefail
cd "$(dirname "$0")/.."
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(tests/test_gpu.py tests/test_decode.py tests/test_flex.py tests/test_fa4.py tests/test_flex_fa4.py)
gpus=${GPUS:-$(python -c "import torch; print(torch.cuda.device_count())")}
if [ "$gpus" -lt 1 ]; then echo "no CUDA device: the GPU tests skip on this machine" >&2; exit 1; fi
logs=${LOGS:-$(mktemp -d)}
mkdir -p "$logs"
python -m pytest -q --co -m gpu -p no:cacheprovider "${files[@]}" 2>/dev/null | grep "::" > "$logs/ids.txt"
total=$(wc -l < "$logs/ids.txt")
echo "$total GPU tests over $gpus GPU(s); logs in $logs"
SECONDS=0
pids=()
for ((i = 0; i < gpus; i++)); do
  awk -v i=$i -v n=$gpus '(NR - 1) % n == i' "$logs/ids.txt" > "$logs/ids$i.txt"
  [ -s "$logs/ids$i.txt" ] || continue
  CUDA_VISIBLE_DEVICES=$i xargs -a "$logs/ids$i.txt" python -m pytest -q -rfE -p no:cacheprovider --durations=5 \
    --junitxml="$logs/gpu$i.xml" > "$logs/gpu$i.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
for ((i = 0; i < gpus; i++)); do
  [ -f "$logs/gpu$i.log" ] && echo "GPU $i: $(grep -E '(passed|failed|error)' "$logs/gpu$i.log" | tail -1)"
done
grep -h -E "^(FAILED|ERROR) " "$logs"/gpu*.log
echo "took $SECONDS s"
exit $rc
