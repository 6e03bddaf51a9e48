#!/usr/bin/env python3
"""HF tokenizers' encoding speed on one thread, the peer of `zt_bench_tokenizer`: the same JSONL
corpus ({"text": ...} lines, e.g. the one zt_bench_tokenizer generates), each text encoded on its
own (Tokenizer.encode, add_special_tokens=False) as a data pipeline does, JSON parsing included.

    RAYON_NUM_THREADS=1 python3 bench/tools/hf_tokenizer_speed.py CORPUS.jsonl DIR...

Prints one `RESULT {json}` line per tokenizer folder (DIR/tokenizer.json).
"""
import json
import os
import sys
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import tokenizers  # noqa: E402

corpus, dirs = sys.argv[1], sys.argv[2:]
with open(corpus, "rb") as f:
    lines = [l for l in f.read().split(b"\n") if l.strip()]
jsonl_bytes = sum(len(l) + 1 for l in lines)
for d in dirs:
    tok = tokenizers.Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    # The same work as zt_bench_tokenizer: whole texts, no truncation or padding from the file.
    tok.no_truncation()
    tok.no_padding()
    start = time.perf_counter()
    tokens = 0
    text_bytes = 0
    encode_seconds = 0.0
    for line in lines:
        text = json.loads(line)["text"]
        t0 = time.perf_counter()
        tokens += len(tok.encode(text, add_special_tokens=False).ids)
        encode_seconds += time.perf_counter() - t0
        text_bytes += len(text.encode("utf-8"))
    seconds = time.perf_counter() - start
    print("RESULT " + json.dumps({
        "bench": "tokenizer_hf", "tokenizer": os.path.basename(os.path.normpath(d)),
        "tokenizers": tokenizers.__version__, "threads": 1, "corpus_mb": round(jsonl_bytes / 1e6, 1),
        "tokens": tokens, "seconds": round(seconds, 2),
        "mb_per_s_per_core": round(jsonl_bytes / 1e6 / seconds, 2),
        "encode_mb_per_s_per_core": round(text_bytes / 1e6 / encode_seconds, 2)}), flush=True)
