# Sourced by scripts/test_gpu.sh and scripts/test_nccl.sh: run_shards N NAME deals the test ids of $logs/ids.txt
# round-robin over N concurrent pytest processes (logs and JUnit files $logs/NAME<i>.log / .xml), each started with
# the environment assignments that the caller's `shard_env i` prints (none: the caller's own), waits for all, prints
# each one's summary line, and returns non-zero when any failed or did not finish.
run_shards() {
  local n=$1 name=$2 i p rc=0
  pids=()
  trap 'kill "${pids[@]}" 2>/dev/null; exit 130' INT TERM
  for ((i = 0; i < n; i++)); do
    awk -v i="$i" -v n="$n" '(NR - 1) % n == i' "$logs/ids.txt" > "$logs/ids$i.txt"
    [ -s "$logs/ids$i.txt" ] || continue
    # shellcheck disable=SC2046  # shard_env prints NAME=value words for env
    env $(shard_env "$i") xargs -d '\n' -a "$logs/ids$i.txt" python -m pytest -q -rfEs -p no:cacheprovider \
      --durations=5 --junitxml="$logs/$name$i.xml" > "$logs/$name$i.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  for ((i = 0; i < n; i++)); do
    [ -f "$logs/$name$i.log" ] && echo "$name $i: $(grep -E '(passed|failed|error)' "$logs/$name$i.log" | tail -1)"
  done
  return $rc
}
