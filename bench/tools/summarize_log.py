#!/usr/bin/env python3
"""One JSON line summing up a trainer_log.jsonl: steady-state tokens/s (the mean of the logged
windows after the first, which holds start-up and warm-up), peak GiB and the logged losses.

    summarize_log.py NAME TRAINER_LOG WALL_SECONDS
"""
import json
import sys

name, path, wall = sys.argv[1], sys.argv[2], int(sys.argv[3])
records = [json.loads(l) for l in open(path) if '"tokens_per_second"' in l and '"loss"' in l]
steady = records[1:] or records
print(json.dumps({
    "run": name, "steps": records[-1]["step"] if records else 0, "wall_s": wall,
    "tokens_per_s": round(sum(r["tokens_per_second"] for r in steady) / max(1, len(steady))),
    "peak_gib": max((r.get("peak_memory_gib") or 0) for r in steady) if steady else None,
    "last_loss": records[-1]["loss"] if records else None,
    "losses": [r["loss"] for r in records]}))
