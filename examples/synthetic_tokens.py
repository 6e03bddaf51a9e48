#!/usr/bin/env python3
"""Writes pre-tokenized JSONL of random token ids, for throughput runs with random-weight models.

    python3 examples/synthetic_tokens.py OUT.jsonl SEQ_LEN [VOCAB] [ROWS]
"""
import json
import random
import sys

path, seq = sys.argv[1], int(sys.argv[2])
vocab = int(sys.argv[3]) if len(sys.argv) > 3 else 32000
rows = int(sys.argv[4]) if len(sys.argv) > 4 else 4096
rng = random.Random(0)
with open(path, "w") as f:
    for _ in range(rows):
        f.write(json.dumps({"input_ids": [rng.randrange(3, vocab) for _ in range(seq)]}) + "\n")
