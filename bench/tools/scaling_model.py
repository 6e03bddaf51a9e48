#!/usr/bin/env python3
"""zerotrain's scaling model: step time and tokens/s per GPU at N ranks from a measured one-GPU
step and a link model (docs/scaling.md says what it assumes and how it was checked).

    scaling_model.py predict PROFILE.json [--link NAME|--bw GBPS --latency US] [--ranks 2,4,8]
                             [--emulated] [--stage S] [--offload]
    scaling_model.py table PROFILE.json...       the docs' table: NVLink 2/4/8, IB 2-16 nodes
    scaling_model.py check PROFILE.json OVERLAP.jsonl --bw GBPS [--latency US]
                                                 predicted vs measured emulated runs

A PROFILE is one model and batch at one rank (bench/gpu_session.sh scaling writes them):
  {"name": "lora-qwen2.5-7b", "shape": "examples/shapes/qwen2.5-7b.json", "mode": "lora",
   "lora_r": 16, "tokens_per_rank": 8192, "fwd_ms": ..., "bwd_ms": ..., "opt_ms": ...,
   "recompute": true}
fwd/bwd/opt are zt_bench_model's ZT_BENCH_PHASES times (bwd includes the recomputed forward).

The model (one optimizer step, no accumulation, per rank; bytes are bf16):
  compute  C = fwd + bwd + opt / S  (S = N from stage 1 on: each rank updates its slice)
  stage 0  all-reduce of the trainable gradients in buckets during backward
  stage 1-2 reduce-scatter of the gradients in buckets during backward, all-gather of the
           updated trainable parameters after the step (not overlapped)
  stage 3  per unit (decoder layer) an all-gather before its forward and before its recomputed
           backward, prefetched one unit ahead; the gradients reduce-scattered per unit
  A collective of B bytes over a ring of N ranks takes latency + B (N-1)/N / bw (all-reduce:
  twice that). What overlaps: a bucket's collective runs beside the backward of the layers
  after it; a prefetched gather beside the unit computing; what does not fit is exposed, and
  the last bucket and the first gather always are. With --emulated (N ranks time-slicing one
  GPU, the tier of docs/build.md), every rank's compute takes N times as long.
"""
import argparse
import json
import math
import sys

# Links (bus bandwidth GB/s as nccl-tests reports it, latency per collective in µs). Sources and
# the reasoning for each figure: docs/scaling.md.
LINKS = {
    "nvlink-h100": {"bw": 360.0, "latency_us": 25.0},   # 8x H100 SXM, NVLink 4, no NVLS
    "nvlink-h200": {"bw": 360.0, "latency_us": 25.0},
    "ib-400": {"bw": 45.0, "latency_us": 60.0},         # one 400 Gb/s NIC per GPU, rail-optimized
    "pcie-socket": {"bw": 2.5, "latency_us": 4000.0},   # the emulated tier: NET/Socket on loopback
}


def shape_params(shape, mode, lora_r):
    """Parameter counts: whole model, per decoder layer, persistent (outside layers), trainable."""
    h, i, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv = shape["num_attention_heads"], shape.get("num_key_value_heads", shape["num_attention_heads"])
    d = h // heads
    qkv_bias = shape.get("model_type") == "qwen2"
    attn = h * h + 2 * h * kv * d + h * h + (h + 2 * kv * d if qkv_bias else 0)
    mlp = 3 * h * i
    layer = attn + mlp + 2 * h
    vocab = shape["vocab_size"]
    persistent = vocab * h * (1 if shape.get("tie_word_embeddings") else 2) + h
    total = L * layer + persistent
    if mode == "lora":
        per = lora_r * ((h + h) + (h + kv * d) * 2 + (h + h) + 2 * (h + i) + (i + h))
        trainable = L * per
    else:
        trainable = total
    return {"total": total, "layer": layer, "layers": L, "persistent": persistent,
            "trainable": trainable}


def collective_ms(nbytes, n, link, kind="rs"):
    if n <= 1 or nbytes <= 0:
        return 0.0
    factor = 2.0 if kind == "ar" else 1.0
    return link["latency_us"] / 1e3 + factor * nbytes * (n - 1) / n / (link["bw"] * 1e9) * 1e3


def step_ms(profile, n, link, stage, emulated=False, bucket_bytes=2 * 5e8):
    """Predicted step time in ms at n ranks, with the parts it is made of."""
    p = profile["params"]
    scale = n if emulated else 1
    fwd, bwd = profile["fwd_ms"] * scale, profile["bwd_ms"] * scale
    opt = profile["opt_ms"] * scale / (n if stage >= 1 else 1)
    L = p["layers"]
    grads = 2.0 * p["trainable"]
    exposed = 0.0
    parts = {}
    if n > 1 and stage <= 2:
        kind = "ar" if stage == 0 else "rs"
        buckets = max(1, math.ceil(grads / bucket_bytes))
        per = collective_ms(grads / buckets, n, link, kind)
        # Bucket k (from the end of backward) can run beside the backward that follows it; the
        # last one cannot. A queue of collectives drains at one at a time.
        hidden_room = bwd * (buckets - 1) / buckets
        rs_exposed = per + max(0.0, per * (buckets - 1) - hidden_room)
        parts["grad_reduce_ms"] = round(per * buckets, 2)
        exposed += rs_exposed
        if stage >= 1:
            gather = collective_ms(grads, n, link, "ag")
            parts["param_gather_ms"] = round(gather, 2)
            exposed += gather
    elif n > 1:
        unit = 2.0 * p["layer"]
        g = collective_ms(unit, n, link, "ag")
        f_unit, b_unit = fwd / L, bwd / L
        # Forward: the first gather alone, then each next one beside the unit computing.
        fwd_exp = g + (L - 1) * max(0.0, g - f_unit)
        # Backward: a gather for the recomputation and a reduce-scatter of the unit's gradients.
        rs = collective_ms(2.0 * p["trainable"] / L, n, link, "rs")
        bwd_exp = g + (L - 1) * max(0.0, g + rs - b_unit) + rs
        parts["gathers_ms"] = round(2 * L * g, 2)
        parts["grad_reduce_ms"] = round(L * rs, 2)
        exposed += fwd_exp + bwd_exp
    total = fwd + bwd + opt + exposed
    parts.update({"compute_ms": round(fwd + bwd + opt, 2), "exposed_ms": round(exposed, 2),
                  "step_ms": round(total, 2)})
    return total, parts


def load_profile(path):
    prof = json.load(open(path))
    shape = json.load(open(prof["shape"]))
    prof["params"] = shape_params(shape, prof.get("mode", "lora"), prof.get("lora_r", 16))
    return prof


def link_from(args):
    if args.bw:
        return {"bw": args.bw, "latency_us": args.latency}
    return LINKS[args.link]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("verb", choices=["predict", "table", "check"])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--link", default="nvlink-h200", choices=sorted(LINKS))
    ap.add_argument("--bw", type=float, default=0.0, help="bus bandwidth GB/s")
    ap.add_argument("--latency", type=float, default=50.0, help="µs per collective")
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--emulated", action="store_true")
    args = ap.parse_args()
    if args.verb == "predict":
        prof = load_profile(args.files[0])
        for n in [int(x) for x in args.ranks.split(",")]:
            t, parts = step_ms(prof, n, link_from(args), args.stage, args.emulated)
            print(json.dumps({"run": prof["name"], "ranks": n, "stage": args.stage,
                              "tokens_per_s_per_gpu": round(prof["tokens_per_rank"] / t * 1e3),
                              **parts}))
    elif args.verb == "table":
        for path in args.files:
            prof = load_profile(path)
            for stage in prof.get("stages", [2]):
                row = {"run": prof["name"], "stage": stage}
                one, _ = step_ms(prof, 1, LINKS["nvlink-h200"], stage)
                row["1"] = round(prof["tokens_per_rank"] / one * 1e3)
                for n in (2, 4, 8):
                    t, _ = step_ms(prof, n, LINKS["nvlink-h200"], stage)
                    row[f"nvlink {n}"] = round(prof["tokens_per_rank"] / t * 1e3)
                for nodes in (2, 4, 8, 16):
                    t, _ = step_ms(prof, 8 * nodes, LINKS["ib-400"], stage)
                    row[f"ib {nodes}x8"] = round(prof["tokens_per_rank"] / t * 1e3)
                print(json.dumps(row))
    else:  # check: measured emulated runs (summarize_timeline.py lines with tokens_per_s)
        prof = load_profile(args.files[0])
        link = link_from(args)
        worst = 0.0
        for line in open(args.files[1]):
            m = json.loads(line)
            if "tokens_per_s" not in m:
                continue
            n, stage = m.get("world", 2), int(str(m.get("stage", 2)).rstrip("off"))
            t, parts = step_ms(prof, n, link, stage, emulated=True)
            # tokens/s of the whole job (all ranks) as the trainer logs it
            predicted = prof["tokens_per_rank"] * n / t * 1e3
            err = predicted / m["tokens_per_s"] - 1
            worst = max(worst, abs(err))
            print(json.dumps({"run": m["run"], "ranks": n, "stage": stage,
                              "measured": m["tokens_per_s"], "predicted": round(predicted),
                              "error": round(err, 3), **parts}))
        print(json.dumps({"worst_error": round(worst, 3)}))
        sys.exit(0 if worst <= 0.15 else 1)


if __name__ == "__main__":
    main()
