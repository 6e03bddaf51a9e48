#!/usr/bin/env python3
"""Markdown rows for docs/performance.md from a GPU session's results folder.

  python3 bench/tools/summarize.py RESULTS_DIR

Reads every `RESULT {json}` line of RESULTS_DIR/*.log (zt_bench_model, hf_baseline.py,
hf_phases.py, zt_bench_engine) and RESULTS_DIR/summary.jsonl (the example scripts), and prints
one table per kind, ours beside the peer's where both measured the same case.
"""
import glob
import json
import os
import sys


def results(folder):
    for path in sorted(glob.glob(os.path.join(folder, "*.log"))):
        for line in open(path, encoding="utf-8", errors="replace"):
            if line.startswith("RESULT "):
                try:
                    yield os.path.basename(path), json.loads(line[7:])
                except json.JSONDecodeError:
                    pass


def case_of(r):
    if "case" in r:  # a peer error: [shape, mode, seq, mbs, ckpt]
        shape, mode, seq, mbs, ckpt = r["case"]
        return shape, mode, int(seq), int(mbs), int(ckpt == "1")
    return r.get("shape"), r.get("mode"), r.get("seq"), r.get("mbs"), int(r.get("ckpt", 0))


def main():
    folder = sys.argv[1]
    steps = {}
    other = []
    for log, r in results(folder):
        if "bench" in r:
            other.append(r)
            continue
        impl = r.get("impl", "transformers" if log.startswith("peer") or "case" in r else "?")
        steps.setdefault(case_of(r), {})[impl] = r
    if steps:
        print("| shape | mode | seq × mbs | ckpt | implementation | tokens/s | peak GiB | fwd / bwd / opt s |")
        print("|---|---|---|---|---|---|---|---|")
        for (shape, mode, seq, mbs, ckpt), by_impl in sorted(steps.items(), key=str):
            for impl, r in sorted(by_impl.items()):
                phases = " / ".join(str(r[k]) for k in ("fwd_s", "bwd_s", "opt_s") if k in r)
                value = r.get("error") or f"{r.get('tokens_per_s', 0):,}"
                print(f"| {shape} | {mode} | {seq} × {mbs} | {ckpt} | {impl} | {value} | "
                      f"{r.get('peak_gib', '')} | {phases} |")
        print()
    summary = os.path.join(folder, "summary.jsonl")
    if os.path.exists(summary):
        print("| example run | steps | tokens/s (after the first window) | peak GiB | wall s | last loss |")
        print("|---|---|---|---|---|---|")
        for line in open(summary):
            r = json.loads(line)
            print(f"| {r['run']} | {r['steps']} | {r['tokens_per_s']:,} | {r['peak_gib']} | "
                  f"{r['wall_s']} | {r['last_loss']:.4f} |")
        print()
    for r in other:
        print("- " + json.dumps(r))


if __name__ == "__main__":
    main()
