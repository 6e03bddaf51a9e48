#!/usr/bin/env python3
"""One JSON line summing up the collectives of a run timed with ZT_COMM_TIMELINE=PREFIX: per
rank, the mean per step (steps after the first, which holds start-up) of the time collectives
were in flight and of the time the compute stream (or host) stood still waiting for them —
the exposed communication — in total and by operation, with the step time from the run's
trainer_log.jsonl.

    summarize_timeline.py NAME PREFIX [TRAINER_LOG [WORLD STAGE [PER_NODE]]]

STAGE may carry the [7/7] modes ("3+hpz+qw"); PER_NODE is the ranks per node they were run with.
"""
import collections
import glob
import json
import sys

name, prefix = sys.argv[1], sys.argv[2]
step_s = None
if len(sys.argv) > 3:
    recs = [json.loads(l) for l in open(sys.argv[3]) if '"tokens_per_second"' in l and '"loss"' in l]
    recs = recs[1:] or recs
    if recs:
        step_s = {"tokens_per_s": round(sum(r["tokens_per_second"] for r in recs) / len(recs))}
ranks = {}
for path in sorted(glob.glob(prefix + ".rank*.jsonl")):
    rank = int(path[len(prefix) + len(".rank"):-len(".jsonl")])
    rows = [json.loads(l) for l in open(path)]
    steps = sorted({r["step"] for r in rows})
    steady = set(steps[1:] or steps)
    per_op = collections.defaultdict(lambda: [0, 0.0, 0.0, 0])  # count, in flight, exposed, bytes
    for r in rows:
        if r["step"] not in steady:
            continue
        o = per_op[r["op"]]
        o[0] += 1
        o[1] += r["in_flight_ms"]
        o[2] += r["exposed_ms"]
        o[3] += r["bytes"]
    n = max(1, len(steady))
    # The exposed time of the largest single collective of a step: the one nothing can hide
    # (the last bucket of backward, the first unit's gather).
    worst = collections.defaultdict(float)
    for r in rows:
        if r["step"] in steady:
            worst[r["step"]] = max(worst[r["step"]], r["exposed_ms"])
    ranks[rank] = {
        "steps": len(steady),
        "in_flight_ms": round(sum(o[1] for o in per_op.values()) / n, 2),
        "exposed_ms": round(sum(o[2] for o in per_op.values()) / n, 2),
        "largest_exposed_ms": round(sum(worst.values()) / n, 2),
        "by_op": {op: {"per_step": round(o[0] / n, 1), "in_flight_ms": round(o[1] / n, 2),
                       "exposed_ms": round(o[2] / n, 2), "gb": round(o[3] / n / 1e9, 3)}
                  for op, o in sorted(per_op.items())},
    }
job = {"world": int(sys.argv[4]), "stage": sys.argv[5]} if len(sys.argv) > 5 else {}
if len(sys.argv) > 6:
    job["per_node"] = int(sys.argv[6])
if job:  # rows measured since EngineOptions::overlap_step_gather (on by default) came in
    job["step_gather_overlap"] = True
print(json.dumps({"run": name, **job, **(step_s or {}), "ranks": ranks}))
