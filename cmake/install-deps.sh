#!/usr/bin/env bash
# `make deps`: installs what a fresh Debian 12 machine lacks to build and test zerotrain, and
# does nothing when everything is found already (so it is harmless where there is no package
# registry, such as the GPU machine, whose LibTorch comes from Python and whose headers come
# from .gpu-deps/). Idempotent.
set -euo pipefail

# Header directories where a dependency may already be.
include_dirs=(/usr/include /usr/local/include)
IFS=: read -r -a cpath <<< "${CPATH:-}"
include_dirs+=("${cpath[@]}")

have_header() {
  local h
  for d in "${include_dirs[@]}"; do
    [ -n "$d" ] || continue
    for h in "$@"; do [ -e "$d/$h" ] && return 0; done
  done
  return 1
}

have_python_torch() { python3 -c 'import torch' >/dev/null 2>&1; }

missing=()
if [ -z "${Torch_DIR:-}" ] && ! have_python_torch; then
  # Debian's CPU LibTorch with c10d, and Gloo's headers for the CPU multi-rank backend.
  have_header torch/csrc/api/include/torch/torch.h || missing+=(libtorch-dev)
  have_header gloo/config.h || missing+=(libgloo-dev)
fi
have_header rapidjson/document.h || missing+=(rapidjson-dev)
have_header fmt/format.h || missing+=(libfmt-dev)
have_header utf8proc.h || missing+=(libutf8proc-dev)
have_header catch2/catch.hpp || missing+=(catch2)
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
command -v make >/dev/null 2>&1 || missing+=(make)
# ccache is optional: it only speeds rebuilds. Ask for it only together with something else.
if [ ${#missing[@]} -gt 0 ] && ! command -v ccache >/dev/null 2>&1; then missing+=(ccache); fi

if [ ${#missing[@]} -eq 0 ]; then
  echo "deps: everything found"
  exit 0
fi

echo "deps: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "deps: run as root or install: ${missing[*]}" >&2; exit 1; }
  sudo=sudo
fi
export DEBIAN_FRONTEND=noninteractive
if ! $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"; then
  $sudo apt-get update -q
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
