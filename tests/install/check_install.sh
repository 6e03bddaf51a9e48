#!/usr/bin/env bash
# Installs the built tree into a temporary prefix, then builds and runs a consumer program
# with find_package(zerotrain) and with pkg-config. Usage: check_install.sh BUILD_DIR SRC_DIR
set -euo pipefail
build=$1
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d /tmp/zt-install.XXXXXX)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null

echo "== find_package(zerotrain)"
cmake -S "$here" -B "$work/cmake-build" -DCMAKE_PREFIX_PATH="$work/prefix;${CMAKE_PREFIX_PATH:-}" >/dev/null
cmake --build "$work/cmake-build" >/dev/null
"$work/cmake-build/consumer"

echo "== pkg-config --cflags --libs zerotrain"
export PKG_CONFIG_PATH="$work/prefix/lib/pkgconfig"
flags=$(pkg-config --cflags --libs zerotrain)
# shellcheck disable=SC2086
g++ "$here/consumer.cpp" -o "$work/pc-consumer" $flags
"$work/pc-consumer"

echo "== installed program"
"$work/prefix/bin/zerotrain" version
