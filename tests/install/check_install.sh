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

echo "== pkg-config --cflags --libs zerotrain-cxx"
export PKG_CONFIG_PATH="$work/prefix/lib/pkgconfig"
cxxflags=$(pkg-config --cflags --libs zerotrain-cxx)
# shellcheck disable=SC2086
g++ "$here/consumer.cpp" -o "$work/pc-consumer" $cxxflags
"$work/pc-consumer"

echo "== installed program"
"$work/prefix/bin/zerotrain" version

echo "== the C API: header, SONAME, a C program through pkg-config"
soname=$(objdump -p "$work/prefix/lib/libzerotrain.so" | awk '/SONAME/ {print $2}')
[ "$soname" = "libzerotrain.so.1" ] || { echo "SONAME is '$soname', expected libzerotrain.so.1" >&2; exit 1; }
cat > "$work/c-consumer.c" <<'C'
#include <stdio.h>
#include <zerotrain/zerotrain.h>
int main(void) {
  zt_trainer *t = NULL;
  zt_status s = zt_trainer_create(NULL, &t);
  if (zt_api_version() != ZT_API_VERSION || s != ZT_ERR_INVALID_ARGUMENT || t != NULL) return 1;
  printf("C consumer: zerotrain %s, API %d, %s\n", zt_version(), zt_api_version(), zt_status_name(s));
  return 0;
}
C
# shellcheck disable=SC2086
flags=$(pkg-config --cflags --libs zerotrain)
# shellcheck disable=SC2086
gcc -std=c99 -Wall -Wextra -Wpedantic -Werror "$work/c-consumer.c" -o "$work/c-consumer" $flags
"$work/c-consumer"

echo "== find_package(zerotrain) from a C project without LibTorch's CMake files: zerotrain::c"
mkdir -p "$work/c-project"
cat > "$work/c-project/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.18)
project(zerotrain_c_consumer C)
find_package(zerotrain 0.1 REQUIRED COMPONENTS c)
if(TARGET zerotrain::zerotrain)
  message(FATAL_ERROR "zerotrain::zerotrain defined although LibTorch was not to be found")
endif()
add_executable(c-consumer c-consumer.c)
target_link_libraries(c-consumer PRIVATE zerotrain::c)
CM
cp "$work/c-consumer.c" "$work/c-project/"
# LibTorch made unfindable (Debian's sits on CMake's default path): only the prefix is there.
env -u Torch_DIR cmake -S "$work/c-project" -B "$work/c-build" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_DISABLE_FIND_PACKAGE_Torch=TRUE >/dev/null
cmake --build "$work/c-build" >/dev/null
"$work/c-build/c-consumer"
