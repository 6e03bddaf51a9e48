#!/usr/bin/env bash
# The Go package against this build: its own tests (`go test`), then its program at N ranks.
#   run_go.sh BUILD_DIR SOURCE_DIR ZEROTRAIN_CLI RANKS
set -euo pipefail
build=$1 src=$2 cli=$3 ranks=$4
# Offline and self-contained: module mode with no dependencies, caches inside the build tree.
export GOCACHE="$build/go-cache" GOPATH="$build/go-path" GOFLAGS=-mod=mod GOPROXY=off GO111MODULE=on
# The package finds the library through pkg-config (#cgo pkg-config: zerotrain): this build
# tree's zerotrain.pc.
export PKG_CONFIG_PATH="$build/pkgconfig-build" OMP_NUM_THREADS=1
cd "$src/examples/go"
go vet ./...
go test -count=1 ./...
go build -o "$build/go_example_train" ./cmd/train
out="$build/go_example_out"
rm -rf "$out"
"$cli" launch --nproc_per_node "$ranks" -- "$build/go_example_train" "$out"
