#!/usr/bin/env bash
# Adds to .gpu-deps/ (made by ../shared/gpu/prepare-deps.sh) the Debian packages the GPU machine
# lacks beyond that script's list: RE2, the linear-time regex engine for user-given patterns
# (docs/peft.md), Oniguruma, HF tokenizers' regex engine (docs/tokenizers.md), and yaml-cpp, the
# reader of YAML options files (docs/config.md). Run it after
# prepare-deps.sh, from the project root, before a device run that carries .gpu-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.gpu-deps}
[ -d "$dest/root" ] || { echo "run ../shared/gpu/prepare-deps.sh first" >&2; exit 1; }
pkgs="libre2-dev libre2-9 libyaml-cpp-dev libyaml-cpp0.7 libonig-dev libonig5"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
( cd "$tmp" && { apt-get download $pkgs >/dev/null 2>&1 || { apt-get update -qq && apt-get download $pkgs; }; } )
for d in "$tmp"/*.deb; do dpkg -x "$d" "$dest/root"; done
echo "added to $dest: $pkgs"
