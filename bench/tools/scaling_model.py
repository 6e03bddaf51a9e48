#!/usr/bin/env python3
"""zerotrain's scaling model: step time and tokens/s per GPU at N ranks from a measured one-GPU
step and a link model (docs/scaling.md says what it assumes and how it was checked).

    scaling_model.py predict PROFILE.json [--link NAME|--bw GBPS --latency US] [--ranks 2,4,8]
                             [--emulated] [--stage S] [--offload]
    scaling_model.py table PROFILE.json...       the docs' table: NVLink 2/4/8, IB 2-16 nodes,
                                                 and each profile's node_modes (parse_modes)
    scaling_model.py check OVERLAP.jsonl --link measured | --bw GBPS [--latency US]
                                                 predicted vs measured emulated runs
    scaling_model.py traffic TRAFFIC.jsonl       bytes sent across nodes per step by mode, measured
                                                 (test_hierarchy.cpp's "tool: traffic by mode")
                                                 beside traffic_across_nodes
    scaling_model.py moe_memory SHAPE.json --world W --ep E [--stage S]
                                                 a mixture's full fine-tuning: bytes per rank
    scaling_model.py long_memory SHAPE.json [--method lora|qlora] [--span N] [--sp S] [--zero3]
                             [--gpu-gib G] [--host-gib H] [--work A] [--tokens T,...]
                                                 long context: GPU and host bytes at T tokens,
                                                 the longest that fits (docs/performance.md)
    scaling_model.py moe_predict SHAPE.json --one-gpu-lora TOK_S [--tokens-per-rank T]
                                                 a mixture's full fine-tuning at 8 GPUs (EP 8) and
                                                 2x8 (EP 8 in a node, 2 expert-data-parallel
                                                 ranks over IB): tokens/s per GPU, all-to-all in

A PROFILE is one model and batch at one rank (bench/gpu_session.sh scaling writes them):
  {"name": "lora-qwen2.5-7b", "shape": "examples/shapes/qwen2.5-7b.json", "mode": "lora",
   "lora_r": 16, "tokens_per_rank": 8192, "fwd_ms": ..., "bwd_ms": ..., "opt_ms": ...,
   "recompute": true}
fwd/bwd/opt are zt_bench_model's ZT_BENCH_PHASES times (bwd includes the recomputed forward).

The model (one optimizer step, no accumulation, per rank; bytes are bf16):
  compute  C = fwd + bwd + opt / S  (S = N from stage 1 on: each rank updates its slice)
  stage 0  all-reduce of the trainable gradients in buckets during backward
  stage 1-2 reduce-scatter of the gradients in buckets during backward, all-gather of the
           updated trainable parameters overlapped with the next forward (overlapped_gather_ms)
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
    "pcie-socket": {"bw": 1.85, "latency_us": 2500.0},  # the emulated tier, measured (docs/scaling.md)
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
            "embedding": vocab * h, "trainable": trainable}


def collective_ms(nbytes, n, link, kind="rs"):
    if n <= 1 or nbytes <= 0:
        return 0.0
    factor = 2.0 if kind == "ar" else 1.0
    return link["latency_us"] / 1e3 + factor * nbytes * (n - 1) / n / (link["bw"] * 1e9) * 1e3


def parse_stage(stage):
    """A stage as gpu_session.sh's overlap rows write it: 2; "2oc" (overlap_comm with 2e8-element
    buckets, HF's ZeRO-2 example); "2no" (overlap_comm false, DeepSpeed's default below stage 3);
    "3off" (both offloads). Returns (stage, overlap, bucket bytes): zerotrain's defaults otherwise
    (overlap on, 5e8-element buckets)."""
    text = str(stage)
    number = int("".join(ch for ch in text if ch.isdigit()))
    if text.endswith("oc"):
        return number, True, 2 * 2e8
    return number, number == 0 or not text.endswith("no"), 2 * 5e8


def pass_ms(gathers, computes, scatters=None):
    """One pass over the units of stage 3 on one compute stream and one FIFO communication
    stream: unit k+1's gather is issued when unit k starts (prefetch one ahead), a unit computes
    once its gather and the previous unit are done, and (backward) its gradients' reduce-scatter
    is issued when it ends. Returns (time until both streams are idle, compute time)."""
    comm_end = 0.0

    def comm(issue, duration):
        nonlocal comm_end
        comm_end = max(issue, comm_end) + duration
        return comm_end

    gathered = [comm(0.0, gathers[0])] + [0.0] * (len(gathers) - 1)
    t = 0.0
    for k, c in enumerate(computes):
        start = max(t, gathered[k])
        if k + 1 < len(gathers):
            gathered[k + 1] = comm(start, gathers[k + 1])
        t = start + c
        if scatters:
            comm(t, scatters[k])
    return max(t, comm_end), sum(computes)


def traffic_across_nodes(params, world, per_node, stage, modes, value_bytes=2.0):
    """Bytes one rank sends to other nodes in a step of full fine-tuning (every parameter
    trainable, in units), as a direct exchange sends them: P/W of the values to each rank of
    the other nodes per gather or reduce-scatter over the job. Stage 3: the forward's gather,
    the recomputing backward's, the gradients' reduce-scatter; stages 1-2: the reduce-scatter
    and the post-step gather. hpz: the backward's gather stays in the node; qw / qg: those
    gathers / the reduce-scatter in int8 blocks (QUANT × 2 bytes a value), qg's second hop
    alone crossing, to the rank at the same place on each other node; mics: only each slice's
    all-reduce over the copies crosses (twice P/W to each other node's rank at the same place)."""
    W, L = world, per_node
    nodes = W // L
    share = params / W * value_bytes
    int8 = params / W * QUANT * 2.0
    if "mics" in modes:
        return 2 * share * (nodes - 1)
    reduce = int8 * (nodes - 1) if "qg" in modes else share * (W - L)
    if stage >= 3:
        forward = (int8 if "qw" in modes else share) * (W - L)
        backward = 0.0 if "hpz" in modes else forward
        return forward + backward + reduce
    return share * (W - L) + reduce


def unit_sizes(p):
    """Units in call order: the embedding, the decoder layers, the output layer (with the final
    norm): their parameters, the forward's compute share of each (matmul weights: the embedding
    is a lookup, the head's matmul is the embedding's size) and their trainable parameters."""
    L = p["layers"]
    sizes = [p["embedding"]] + [p["layer"]] * L + [p["persistent"] - p["embedding"]]
    work = [0.0] + [float(p["layer"])] * L + [float(p["embedding"])]
    share = [w / sum(work) for w in work]
    if p["trainable"] < p["total"]:  # adapters: all in the decoder layers
        trainable = [0.0] + [p["trainable"] / L] * L + [0.0]
    else:
        trainable = sizes
    return sizes, share, trainable


# ZeRO++'s int8 blocks against bf16: 256 values in 256 bytes plus a 4-byte scale, over 512.
QUANT = (256 + 4) / 512


def parse_modes(stage):
    """The [7/7] modes after a stage, '+'-separated: "3+hpz+qw+qg", "2+mics". hpz: stage 3's
    gathers after the first within the node (zero_hpz_partition_size = ranks per node); mics:
    shard groups of one node (mics_shard_size); qw / qg: int8 weight gathers / gradient
    reduce-scatters (two hops across nodes). Returns (the stage text, the set of modes)."""
    parts = str(stage).split("+")
    modes = set(parts[1:])
    unknown = modes - {"hpz", "mics", "qw", "qg"}
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)} in stage {stage!r}")
    return parts[0], modes


def overlapped_gather_ms(trainable, computes, bucket_bytes, n, link, cost=None):
    """Stages 1-2 (EngineOptions::overlap_step_gather): the step's all-gathers of the trainable
    buckets, issued together when the next forward's first unit runs, in unit order on one FIFO
    stream; each bucket must be complete before its first unit computes. Buckets are cut from the
    last parameter backwards, bucket_bytes of bf16 each, as the layout cuts them. Returns (the
    forward's exposed time, the gathers' total time)."""
    buckets, acc, first = [], 0.0, len(trainable) - 1
    for k in range(len(trainable) - 1, -1, -1):
        acc += 2.0 * trainable[k]
        first = k
        if acc >= bucket_bytes:
            buckets.append((first, acc))
            acc = 0.0
    if acc > 0:
        buckets.append((first, acc))
    buckets.sort()
    done, t_comm = [], 0.0
    for unit, nbytes in buckets:
        t_comm += cost(nbytes) if cost else collective_ms(nbytes, n, link, "ag")
        done.append((unit, t_comm))
    t = 0.0
    for k, c in enumerate(computes):
        ready = max([d for u, d in done if u <= k], default=0.0)
        t = max(t, ready) + c
    return max(t, t_comm) - sum(computes), t_comm


def step_ms(profile, n, link, stage, emulated=False, kappa=1.0, agreements=4,
            gather_overlap=True, intra=None, per_node=None):
    """Predicted step time in ms at n ranks, with the parts it is made of. `kappa`: how much
    longer than n times one rank's compute n ranks time-slicing one GPU take (measured, see
    docs/scaling.md); `agreements`: the small all-reduces of every step (the trainer's flags,
    the gradient norm, the logged loss), each one latency; `gather_overlap`: stages 1-2 overlap
    the step's parameter all-gathers with the next forward (false: rows measured before
    EngineOptions::overlap_step_gather, which ran them alone after the step); `intra`, `per_node`:
    the link inside a node and its ranks, where `link` joins the nodes (the modes of
    parse_modes keep traffic on `intra`; without them the ring runs at `link`)."""
    stage, modes = parse_modes(stage)
    stage, overlap, bucket_bytes = parse_stage(stage)
    intra = intra or link
    per_node = min(per_node or n, n)
    nodes = max(1, n // per_node)

    def reduce_ms(nbytes):
        """One bucket's gradient reduce-scatter (stages 1-3)."""
        if "mics" in modes:  # within the node, then the slice over the copies
            return (collective_ms(nbytes, per_node, intra, "rs")
                    + collective_ms(nbytes / per_node, nodes, link, "ar"))
        if "qg" in modes and nodes > 1:  # two int8 hops
            return (collective_ms(QUANT * nbytes, per_node, intra, "rs")
                    + collective_ms(QUANT * nbytes / per_node, nodes, link, "rs"))
        if "qg" in modes:
            return collective_ms(QUANT * nbytes, n, link, "rs")
        return collective_ms(nbytes, n, link, "rs")

    def gather_ms(nbytes, within_node=False, quantized=False):
        if "mics" in modes or within_node:
            return collective_ms(nbytes, per_node, intra, "ag")
        return collective_ms((QUANT if quantized else 1.0) * nbytes, n, link, "ag")

    p = profile["params"]
    scale = n * kappa if emulated else 1
    fwd, bwd = profile["fwd_ms"] * scale, profile["bwd_ms"] * scale
    opt = profile["opt_ms"] * scale / (n if stage >= 1 else 1)
    grads = 2.0 * p["trainable"]
    exposed = agreements * link["latency_us"] / 1e3 if n > 1 else 0.0
    parts = {}
    if n > 1 and stage <= 2:
        buckets = max(1, math.ceil(grads / bucket_bytes))
        per = (collective_ms(grads / buckets, n, link, "ar") if stage == 0
               else reduce_ms(grads / buckets))
        if overlap:
            # Bucket k (from the end of backward) can run beside the backward that follows it;
            # the last one cannot. A queue of collectives drains one at a time.
            hidden_room = bwd * (buckets - 1) / buckets
            rs_exposed = per + max(0.0, per * (buckets - 1) - hidden_room)
        else:
            rs_exposed = per * buckets  # reduced after backward (overlap_comm off)
        parts["grad_reduce_ms"] = round(per * buckets, 2)
        exposed += rs_exposed
        if stage >= 1 and gather_overlap:
            sizes, share, trainable = unit_sizes(p)
            gather_exposed, gather = overlapped_gather_ms(
                trainable, [fwd * s for s in share], bucket_bytes, n, link, cost=gather_ms)
            parts["param_gather_ms"] = round(gather, 2)
            parts["param_gather_exposed_ms"] = round(gather_exposed, 2)
            exposed += gather_exposed
        elif stage >= 1:
            gather = gather_ms(grads)
            parts["param_gather_ms"] = round(gather, 2)
            exposed += gather
    elif n > 1:
        # Each unit gathered for forward and again for the recomputing backward. With hpZ the
        # backward's gathers stay in the node, and so do the forward's of a frozen base (its
        # secondary copy stands); the trainable values cross the job once a step.
        sizes, share, trainable = unit_sizes(p)
        qw = "qw" in modes
        if "hpz" in modes:
            g_fwd = [gather_ms(2.0 * (s - t), within_node=True)
                     + (gather_ms(2.0 * t, quantized=qw) if t > 0 else 0.0)
                     for s, t in zip(sizes, trainable)]
            g_bwd = [gather_ms(2.0 * s, within_node=True) for s in sizes]
        else:
            g_fwd = [gather_ms(2.0 * s, quantized=qw) for s in sizes]
            g_bwd = g_fwd
        rs = [reduce_ms(2.0 * t) if t > 0 else 0.0 for t in trainable]
        f_total, f_compute = pass_ms(g_fwd, [fwd * s for s in share])
        b_total, b_compute = pass_ms(g_bwd[::-1], [bwd * s for s in share[::-1]], rs[::-1])
        parts["gathers_ms"] = round(sum(g_fwd) + sum(g_bwd), 2)
        parts["grad_reduce_ms"] = round(sum(rs), 2)
        exposed += (f_total - f_compute) + (b_total - b_compute)
    total = fwd + bwd + opt + exposed
    parts.update({"compute_ms": round(fwd + bwd + opt, 2), "exposed_ms": round(exposed, 2),
                  "step_ms": round(total, 2)})
    return total, parts


def optimizer_ms(trainable):
    """AdamW over fp32 masters from a bf16 gradient, memory-bound: masters, both moments read
    and written, the gradient read, the bf16 copy written (28 bytes an element) at ~3 TB/s."""
    return trainable * 28 / 3e12 * 1e3


def load_profile(path):
    prof = json.load(open(path))
    shape = json.load(open(prof["shape"]))
    prof["params"] = shape_params(shape, prof.get("mode", "lora"), prof.get("lora_r", 16))
    return prof


def profile_from_run(mode, shape, tokens_per_s, tokens_per_rank, recompute=True, lora_r=16):
    """A profile from one rank's measured throughput: the step less the optimizer's estimate,
    split 1:3 forward:backward with recomputation (1:2 without)."""
    params = shape_params(json.load(open(f"examples/shapes/{shape}.json")), mode, lora_r)
    step = tokens_per_rank / tokens_per_s * 1e3
    opt = optimizer_ms(params["trainable"])
    fwd = (step - opt) / (4 if recompute else 3)
    return {"name": f"{mode}-{shape}", "tokens_per_rank": tokens_per_rank, "fwd_ms": fwd,
            "bwd_ms": step - opt - fwd, "opt_ms": opt, "params": params}


def link_from(args):
    if args.bw:
        return {"bw": args.bw, "latency_us": args.latency}
    return LINKS[args.link]


def measured_links(rows):
    """The emulated link at each world size, read off the same file's timelines (rank 0): the bus
    bandwidth of stage 1/2's post-step all-gather of at least 0.5 GB (it runs alone, after the
    step: its time in flight is its transfer time), bytes (n-1)/n over time as nccl-tests counts
    it, the median over those rows; the latency, the median time of one scalar all-reduce (the
    trainer's agreements). The ranks share one host's loopback and its copying, so the link is
    slower the more ranks there are: it is measured per world, not assumed."""
    bws, lats = {}, {}
    for r in rows:
        n = r.get("world", 1)
        ops = r.get("ranks", {}).get("0", {}).get("by_op", {})
        if n < 2 or not ops:
            continue
        ag, ar = ops.get("all_gather"), ops.get("all_reduce")
        stage, modes = parse_modes(str(r["stage"]))
        if parse_stage(stage)[0] in (1, 2) and not modes and ag and ag["gb"] >= 0.5:
            bws.setdefault(n, []).append(ag["gb"] * (n - 1) / n / (ag["in_flight_ms"] / 1e3))
        if ar and ar["gb"] == 0 and ar["per_step"]:
            lats.setdefault(n, []).append(ar["in_flight_ms"] / ar["per_step"] * 1e3)
    median = lambda xs: sorted(xs)[len(xs) // 2]
    return {n: {"bw": round(median(bws[n]), 3), "latency_us": round(median(lats[n]))}
            for n in bws if n in lats}


def check(args):
    """Predicts each emulated multi-rank row of an overlap file (summarize_timeline.py lines) from
    the same file's one-rank row of that mode and shape (with offload: the offloaded one). With
    --link measured, the link at each world size is the one measured_links reads off the file."""
    rows = [json.loads(line) for line in open(args.files[0]) if line.strip()]
    one = {r["run"].rsplit("-z", 1)[0] + ("off" if "off" in str(r["stage"]) else ""): r
           for r in rows if r.get("world") == 1}
    links = measured_links(rows) if args.link == "measured" else {}
    for n, link in sorted(links.items()):
        print(json.dumps({"world": n, "measured_link": link}))
    worst = 0.0
    for m in rows:
        n = m.get("world", 2)
        if n == 1 or "tokens_per_s" not in m:
            continue
        base = m["run"].rsplit("-z", 1)[0]
        key = base + ("off" if "off" in str(m["stage"]) else "")
        if key not in one:
            print(json.dumps({"run": m["run"], "skipped": f"no one-rank row for {key}"}))
            continue
        mode, shape = base.split("-", 1)
        prof = profile_from_run(mode, shape, one[key]["tokens_per_s"], args.tokens_per_rank)
        link = links[n] if args.link == "measured" else link_from(args)
        t, parts = step_ms(prof, n, link, m["stage"], emulated=True, kappa=args.kappa,
                           gather_overlap=bool(m.get("step_gather_overlap", False)),
                           per_node=m.get("per_node"))
        predicted = prof["tokens_per_rank"] * n / t * 1e3  # the whole job's, as the trainer logs
        err = predicted / m["tokens_per_s"] - 1
        worst = max(worst, abs(err))
        measured_exposed = m["ranks"]["0"]["exposed_ms"] if m.get("ranks") else None
        print(json.dumps({"run": m["run"], "ranks": n, "stage": m["stage"],
                          "measured": m["tokens_per_s"], "predicted": round(predicted),
                          "error": round(err, 3), "measured_exposed_ms": measured_exposed,
                          **parts}))
    print(json.dumps({"worst_error": round(worst, 3)}))
    sys.exit(0 if worst <= 0.15 else 1)


def moe_params(shape):
    """A Qwen3-MoE-like shape's parameters: (dense, experts). Dense: embeddings, the output layer,
    attention (with q/k norms), norms, routers; experts: every layer's fused gate/up/down."""
    h, L, V = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    heads, kv = shape["num_attention_heads"], shape.get("num_key_value_heads", shape["num_attention_heads"])
    d = shape.get("head_dim") or h // heads
    E, mi = shape["num_experts"], shape["moe_intermediate_size"]
    attn = h * heads * d + 2 * h * kv * d + heads * d * h + 2 * d
    dense = V * h * (1 if shape.get("tie_word_embeddings") else 2) + h
    dense += L * (attn + 2 * h + E * h)
    experts = L * E * 3 * h * mi
    return dense, experts


def moe_memory(shape, world, ep, stage):
    """Bytes a rank keeps for bf16 full fine-tuning with fp32 masters and AdamW (docs/scaling.md,
    "Mixtures of experts"): the compute copy of the dense part and of its E/ep experts (2 bytes a
    value); per optimizer-state element 16 bytes (fp32 master, fp32 gradient accumulator, two fp32
    moments) — the dense part's split over the world from stage 1 on, the experts' kept whole by
    every rank holding them; stages 0-1 also keep a flat bf16 gradient of every trainable value."""
    dense, experts = moe_params(shape)
    mine = experts / ep
    state_dense = dense / (world if stage >= 1 else 1)
    out = {"dense_params": dense, "expert_params": experts, "world": world, "ep": ep,
           "stage": stage}
    out["compute_gib"] = 2 * (dense + mine) / 2**30
    out["optimizer_state_gib"] = 16 * (state_dense + mine) / 2**30
    out["flat_gradients_gib"] = 2 * (dense + mine) / 2**30 if stage <= 1 else 0.0
    out["per_rank_gib"] = out["compute_gib"] + out["optimizer_state_gib"] + out["flat_gradients_gib"]
    return out


def moe_predict(shape, lora_tok_s, tokens, gpus, ep, intra, inter):
    """Full fine-tuning of a mixture (bf16, fp32 masters, AdamW, ZeRO-2, activation checkpointing)
    at `gpus` ranks with expert parallelism `ep` inside a node (docs/scaling.md, "Mixtures of
    experts"). Compute per token from a measured one-GPU LoRA step of the same shape: LoRA with
    recomputation costs ~6 active-parameter FLOPs a token (forward, recomputed forward, the input
    gradients), full fine-tuning ~8 (the weight gradients too). Per layer six all-to-alls of the
    routed rows (dispatch and combine in the forward, the recomputed forward and the backward),
    each T·k·h bf16 values of which (ep−1)/ep leave the rank, plus two latency-bound count
    exchanges; not overlapped (zerotrain's exchange is not yet). The dense gradients are
    reduce-scattered over all ranks and the experts' over their expert-data-parallel group
    (gpus / ep ranks, across nodes), overlapped with backward as zerotrain's buckets are; the
    updated slices all-gathered after the step."""
    h, L, k = shape["hidden_size"], shape["num_hidden_layers"], shape["num_experts_per_tok"]
    dense, experts = moe_params(shape)
    compute = tokens / lora_tok_s * 1e3 * 8.0 / 6.0
    a2a_bytes = tokens * k * h * 2.0 * (ep - 1) / ep
    per_a2a = (intra["latency_us"] / 1e3 + a2a_bytes / (intra["bw"] * 1e9) * 1e3) if ep > 1 else 0.0
    counts = intra["latency_us"] / 1e3 if ep > 1 else 0.0
    a2a = L * (6 * per_a2a + 3 * counts)
    link = intra if gpus <= 8 else inter
    edp = gpus // ep
    dense_rs = collective_ms(2.0 * dense, gpus, link, "rs")
    expert_rs = collective_ms(2.0 * experts / ep, edp, inter if gpus > 8 else intra, "rs")
    backward = compute * 6.0 / 8.0  # recomputed forward + backward: 6 of the 8 units
    # Buckets of 5e8 elements drain one at a time beside the backward after them; the last one
    # cannot hide (as step_ms has it).
    reduce = dense_rs + expert_rs
    buckets = max(1, math.ceil((dense + experts / ep) / 5e8))
    per = reduce / buckets
    reduce_exposed = per + max(0.0, reduce - per - backward * (buckets - 1) / buckets)
    gather = collective_ms(2.0 * dense, gpus, link, "ag") + \
        collective_ms(2.0 * experts / ep, edp, inter if gpus > 8 else intra, "ag")
    optimizer = optimizer_ms(dense / gpus + experts / ep / max(edp, 1))
    total = compute + a2a + reduce_exposed + gather + optimizer
    return {"gpus": gpus, "ep": ep, "tokens_per_rank": tokens, "compute_ms": round(compute, 1),
            "all_to_all_ms": round(a2a, 1), "grad_reduce_exposed_ms": round(reduce_exposed, 1),
            "param_gather_ms": round(gather, 1), "optimizer_ms": round(optimizer, 1),
            "step_ms": round(total, 1), "tokens_per_s_per_gpu": round(tokens / total * 1e3)}


GIB = 1024.0 ** 3


def pow2_at_least(n):
    """The page-locked block LibTorch's caching host allocator makes for n bytes."""
    return 1 << max(0, math.ceil(math.log2(n))) if n > 0 else 0


def long_memory(shape, tokens, method="lora", span=2, work=None, gpu_gib=139.0, host_gib=None,
                sp=1, zero3=False, lora_r=16):
    """The long-context memory model (docs/performance.md): one sequence of `tokens` tokens at
    micro-batch 1, checkpointing with `span` layers per saved input held in page-locked host
    memory (use_unsloth_gc, recompute_num_layers), the tiled MLP, at `sp` ranks of Ulysses
    sequence parallelism (each holds tokens / sp positions). GPU bytes per rank:
        weights + trainable state + work · u + (checkpoints the host budget cannot hold) · u
    where u = tokens / sp · hidden · 2 bytes (one layer's input in bf16) and `work` the measured
    working set in units of u (one layer's recomputation and backward, the head's saved values,
    the first layer's input, the checkpoints fetched back, the exchange buffers). Host bytes:
    ceil(L / span) saved inputs (2 L with spans of one: each layer's input and its kept sum;
    the first input stays on the GPU with adapters: the frozen embeddings' output needs no
    gradient), each a power-of-two block, within 3/4 of `host_gib` shared by the node's ranks
    (up to 8). Under sequence parallelism the all-to-alls' send and receive buffers add
    SP_EXCHANGE layer inputs of the rank's slice (q, k, v out and in, an estimate)."""
    p = shape_params(shape, "lora" if method in ("lora", "qlora") else "full", lora_r)
    h, L = shape["hidden_size"], shape["num_hidden_layers"]
    if method == "qlora":  # NF4 linear weights + double-quantized absmax; embeddings, head bf16
        linear = p["total"] - p["persistent"]
        weights = linear * (0.5 + 0.127 / 8) + 2 * p["persistent"]
    else:
        weights = 2 * p["total"]
    if zero3:
        weights /= sp
    state = 18 * p["trainable"]  # bf16 value, fp32 master, gradient and two Adam moments
    if work is None:
        work = WORK_SPAN if span > 1 else WORK_ONE
    if sp > 1:
        work += SP_EXCHANGE
    u = tokens / sp * h * 2
    # Spans of one keep each layer's sum after attention beside its input, and with adapters
    # the first layer's input (the frozen embeddings' output) stays on the GPU (in `work`).
    # Longer spans recompute every unit: the L + 2 units (embeddings, layers, head) start a span
    # every `span` units, the embeddings' with no activation to save.
    if span > 1:
        saved = math.ceil((L + 2) / span) - 1
    else:
        saved = 2 * L - (1 if method in ("lora", "qlora") else 0)
    node_ranks = min(sp, 8)
    host_budget = 0.75 * (host_gib if host_gib is not None else 120.0) * GIB / node_ranks
    block = pow2_at_least(int(u))
    on_host = min(saved, int(host_budget // block)) if block > 0 else saved
    gpu = weights + state + work * u + (saved - on_host) * u
    return {"tokens": tokens, "method": method, "span": span, "sp": sp, "gpu_gib": gpu / GIB,
            "fits": gpu <= gpu_gib * GIB, "weights_gib": weights / GIB, "work_u": work,
            "u_gib": u / GIB, "saved_inputs": saved, "on_host": on_host,
            "host_gib": on_host * block / GIB}


def longest(shape, method, span, work, gpu_gib, host_gib, sp=1, zero3=False, step=1024):
    """The longest sequence (a multiple of `step` tokens) long_memory says fits."""
    lo, hi = 0, step
    while long_memory(shape, hi, method, span, work, gpu_gib, host_gib, sp, zero3)["fits"]:
        lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if long_memory(shape, mid, method, span, work, gpu_gib, host_gib, sp, zero3)["fits"]:
            lo = mid
        else:
            hi = mid
    return lo


# The working set in layer inputs (docs/performance.md, "The long-context memory model"): with
# spans of one measured (the LLaMA-3-8B shape at 131,072 tokens, tiled MLP, use_unsloth_gc);
# with longer spans that less the first layer's input and the head's two (recomputed units
# now), plus the rebuilt input beside its span's saved one — an estimate until measured.
WORK_ONE = 17.0
WORK_SPAN = 15.0
SP_EXCHANGE = 3.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("verb", choices=["predict", "table", "check", "moe_memory", "moe_predict",
                                     "long_memory", "traffic"])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--link", default="nvlink-h200", choices=sorted(LINKS) + ["measured"],
                    help="measured (check only): each world's emulated link from the file itself")
    ap.add_argument("--bw", type=float, default=0.0, help="bus bandwidth GB/s")
    ap.add_argument("--latency", type=float, default=50.0, help="µs per collective")
    ap.add_argument("--ranks", default="2,4,8")
    ap.add_argument("--stage", default="2")
    ap.add_argument("--emulated", action="store_true")
    ap.add_argument("--kappa", type=float, default=1.0,
                    help="emulated ranks: time-slicing cost beyond N times one rank's compute")
    ap.add_argument("--tokens-per-rank", type=int, default=4096)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--one-gpu-lora", type=float, default=0.0,
                    help="moe_predict: a measured one-GPU LoRA step's tokens/s on the shape")
    ap.add_argument("--method", default="lora", choices=["lora", "qlora", "full"])
    ap.add_argument("--span", type=int, default=2, help="long_memory: recompute_num_layers")
    ap.add_argument("--work", type=float, default=None,
                    help="long_memory: the working set in layer inputs (default: the measured one)")
    ap.add_argument("--gpu-gib", type=float, default=139.0)
    ap.add_argument("--host-gib", type=float, default=120.0, help="the host's available memory")
    ap.add_argument("--sp", type=int, default=1, help="long_memory: sequence_parallel_size")
    ap.add_argument("--zero3", action="store_true", help="long_memory: weights partitioned")
    ap.add_argument("--tokens", default="", help="long_memory: lengths to predict (comma list)")
    args = ap.parse_args()
    if args.verb == "traffic":
        # Measured bytes across nodes per step (test_hierarchy.cpp's "tool: traffic by mode",
        # fp32 on the CPU: 4 bytes a value) beside traffic_across_nodes.
        rows = [json.loads(line) for line in open(args.files[0]) if line.strip()]
        plain = {r["stage"]: r["inter_bytes"] for r in rows if not r["modes"]}
        worst = 0.0
        for r in rows:
            modes = set(filter(None, r["modes"].split("+")))
            want = traffic_across_nodes(r["params"], r["world"], r["per_node"], r["stage"], modes,
                                        value_bytes=4.0)
            err = r["inter_bytes"] / want - 1
            worst = max(worst, abs(err))
            print(json.dumps({"stage": r["stage"], "modes": r["modes"] or "plain",
                              "measured_across": r["inter_bytes"], "model": round(want),
                              "error": round(err, 3),
                              "of_plain": round(r["inter_bytes"] / plain[r["stage"]], 3)}))
        print(json.dumps({"worst_error": round(worst, 3)}))
        return
    if args.verb == "long_memory":
        with open(args.files[0]) as f:
            shape = json.load(f)
        for t in [int(x) for x in args.tokens.split(",") if x]:
            row = long_memory(shape, t, args.method, args.span, args.work, args.gpu_gib,
                              args.host_gib, args.sp, args.zero3)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v
                              for k, v in row.items()}))
        best = longest(shape, args.method, args.span, args.work, args.gpu_gib, args.host_gib,
                       args.sp, args.zero3)
        print(json.dumps({"longest_tokens": best, "method": args.method, "span": args.span,
                          "sp": args.sp, "gpu_gib": args.gpu_gib, "host_gib": args.host_gib}))
        return
    if args.verb == "moe_predict":
        with open(args.files[0]) as f:
            shape = json.load(f)
        for gpus in (8, 16):
            row = moe_predict(shape, args.one_gpu_lora, args.tokens_per_rank, gpus, 8,
                              LINKS["nvlink-h200"], LINKS["ib-400"])
            print(json.dumps({"run": "moe_predict " + args.files[0], **row}))
        return
    if args.verb == "moe_memory":
        with open(args.files[0]) as f:
            shape = json.load(f)
        row = moe_memory(shape, args.world, args.ep, int(args.stage))
        print(json.dumps({"run": "moe_memory " + args.files[0],
                          **{k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}}))
    elif args.verb == "predict":
        prof = load_profile(args.files[0])
        for n in [int(x) for x in args.ranks.split(",")]:
            t, parts = step_ms(prof, n, link_from(args), args.stage, args.emulated, args.kappa)
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
            # The [7/7] modes across nodes: NVLink inside each node of 8, IB between them.
            for stage in prof.get("node_modes", []):
                row = {"run": prof["name"], "stage": stage}
                one, _ = step_ms(prof, 1, LINKS["nvlink-h200"], str(stage).split("+")[0])
                row["1"] = round(prof["tokens_per_rank"] / one * 1e3)
                for nodes in (2, 4, 8, 16):
                    t, _ = step_ms(prof, 8 * nodes, LINKS["ib-400"], stage,
                                   intra=LINKS["nvlink-h200"], per_node=8)
                    row[f"ib {nodes}x8"] = round(prof["tokens_per_rank"] / t * 1e3)
                print(json.dumps(row))
    else:
        check(args)


if __name__ == "__main__":
    main()
