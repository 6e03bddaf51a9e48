#!/usr/bin/env bash
# The benchmarks run and print their RESULT lines (on a tiny shape and small sizes), so they do
# not rot between GPU sessions.   smoke.sh BIN_DIR
set -euo pipefail
bin=$1
check() {  # NAME KEY COMMAND...: the command's last RESULT line must hold KEY
  local name=$1 key=$2
  shift 2
  local out
  out=$("$@" 2>&1) || { echo "$out"; echo "$name failed"; exit 1; }
  echo "$out" | grep '^RESULT' | tail -1 | grep -q "\"$key\"" || { echo "$out"; echo "$name: no $key"; exit 1; }
}
for mode in full full_amp lora freeze; do
  check "model $mode" tokens_per_s env ZT_BENCH_PHASES=1 "$bin/zt_bench_model" tiny $mode 16 2 1 2
done
# Real lengths (padded, and packed into rows of 16): lengths 3..9 in a file, as the peer's.
lengths=$(mktemp)
trap 'rm -f "$lengths"' EXIT
for i in $(seq 0 59); do echo $((3 + i % 7)); done > "$lengths"
for mode in lora_varlen lora_packed; do
  check "model $mode" padding env ZT_BENCH_LENGTHS="$lengths" "$bin/zt_bench_model" tiny $mode 16 2 1 2
done
check "adamw" gparams_per_s env ZT_BENCH_ADAM_MILLIONS=1 ZT_BENCH_ITERS=2 "$bin/zt_bench_engine" adamw
check "tokenizer" mb_per_s_per_core "$bin/zt_bench_tokenizer" --mb 0.05
check "generate" tokens_per_s "$bin/zt_bench_generate" tiny 3 5 4 2
echo "bench smoke: OK"
