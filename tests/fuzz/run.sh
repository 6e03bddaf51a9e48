#!/usr/bin/env bash
# Runs every fuzz target of a ZT_FUZZ build for SECONDS each, starting from the committed corpus
# (tests/fuzz/corpus/<target>/, never modified here: new inputs go to BUILD/fuzz-corpus/).
#   tests/fuzz/run.sh BUILD_DIR SECONDS [TARGET...]
# A crash, leak of a sanitizer report or timeout fails the run; the input is kept in
# BUILD/fuzz-artifacts/ (turn it into a regression test in tests/test_hostile.cpp).
set -euo pipefail
build=$(cd "$1" && pwd) seconds=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
targets=${*:-fuzz_safetensors fuzz_json_config fuzz_tokenizer fuzz_sentencepiece fuzz_jsonl fuzz_checkpoint fuzz_capi_options fuzz_pattern fuzz_data_cache fuzz_chat_template}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export ZT_LOG_LEVEL=error OMP_NUM_THREADS=1 ZT_CPU_THREADS=1
mkdir -p "$build/fuzz-artifacts"
status=0
for t in $targets; do
  work="$build/fuzz-corpus/$t"
  mkdir -p "$work"
  max_len=16384
  [ "$t" = fuzz_tokenizer ] && max_len=65536
  echo "== $t: $seconds s"
  if ! "$build/bin/$t" -max_total_time="$seconds" -max_len="$max_len" -timeout=30 -rss_limit_mb=4096 \
       -print_final_stats=1 -artifact_prefix="$build/fuzz-artifacts/$t-" "$work" "$here/corpus/$t" \
       > "$build/fuzz-$t.log" 2>&1; then
    echo "$t FAILED (see $build/fuzz-$t.log):"
    tail -40 "$build/fuzz-$t.log"
    status=1
  else
    grep -E "stat::number_of_executed_units|cov:" "$build/fuzz-$t.log" | tail -2
  fi
done
exit $status
