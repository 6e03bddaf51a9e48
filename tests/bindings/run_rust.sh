#!/usr/bin/env bash
# The Rust crate against this build: its own tests (`cargo test`), then its program at N ranks.
#   run_rust.sh BUILD_DIR SOURCE_DIR ZEROTRAIN_CLI RANKS
set -euo pipefail
build=$1 src=$2 cli=$3 ranks=$4
export CARGO_TARGET_DIR="$build/rust-target" ZEROTRAIN_LIB_DIR="$build/lib" OMP_NUM_THREADS=1
cd "$src/examples/rust"
# Offline: the crate needs nothing outside std. One test thread: the library's log sink and
# random seed are process-wide.
cargo test --offline --quiet -- --test-threads=1
cargo build --offline --quiet --bin train
out="$build/rust_example_out"
rm -rf "$out"
"$cli" launch --nproc_per_node "$ranks" -- "$CARGO_TARGET_DIR/debug/train" "$out"
