#!/usr/bin/env python3
"""bitsandbytes' blockwise quantization, written again from its source (csrc/kernels.cu and
bitsandbytes/functional.py at 95f9af3; docs/quantization.md) in plain Python, and the vectors
that check zerotrain's quantizer against it.

    python3 tests/tools/bnb_reference.py OUT.json
    python3 tests/tools/bnb_reference.py folder SRC_MODEL_DIR OUT_DIR nf4|fp4 double|single

Every fp32 operation is done in Python's double and rounded to fp32 with struct: a product of
two fp32 values is exact in double, and for +, − and ÷ rounding the double result again gives
the correctly rounded fp32 one (53 ≥ 2·24 + 2 bits), so the arithmetic is IEEE fp32's. The
reciprocal of a block's absmax is therefore IEEE's, where bitsandbytes' CUDA build takes an
approximate one: the vectors put a power of two in every block whose codes are to agree with
the GPU too, where both are exact. No numpy or torch is needed; with torch installed (the GPU
machine), the 8-bit dynamic map is also computed with torch's own linspace, as bitsandbytes does;
without it, with the map torch 2.11 computed there (tests/fixtures/quant/torch_dynamic_map.json).
The run fails if either differs from the plain one.
"""
import fractions
import json
import math
import os
import random
import struct
import sys


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def bits32(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def from_bits32(b):
    return struct.unpack("<f", struct.pack("<I", b))[0]


def f32_exact(q):
    """The fp32 value nearest the rational q (ties to even): one rounding, as a fused
    multiply-add gives."""
    guess = f32(float(q))
    best = None
    for cand in (guess, next_up(guess), next_down(guess)):
        d = abs(fractions.Fraction(cand) - q)
        if best is None or d < best[0] or (d == best[0] and bits32(cand) % 2 == 0):
            best = (d, cand)
    return best[1]


def literal32(text):
    """The fp32 value a C compiler gives the literal `text`f (decimal → fp32, nearest-even)."""
    return f32_exact(fractions.Fraction(text))


def next_up(x):
    b = bits32(x)
    if x == 0:
        return from_bits32(1)
    return from_bits32(b + 1) if x > 0 else from_bits32(b - 1)


def next_down(x):
    return -next_up(-x)


def bf16_to_f32(b):
    return from_bits32(b << 16)


def f32_to_bf16(x):  # round to nearest even, as c10::BFloat16
    b = bits32(x)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def f16_to_f32(b):
    return struct.unpack("<e", struct.pack("<H", b))[0]


def f32_to_f16(x):
    return struct.unpack("<H", struct.pack("<e", x))[0]


# nf4_dequantization_lut and fp4_dequantization_lut (kernels.cu).
NF4 = [literal32(s) for s in (
    "-1.0", "-0.6961928009986877", "-0.5250730514526367", "-0.39491748809814453",
    "-0.28444138169288635", "-0.18477343022823334", "-0.09105003625154495", "0.0",
    "0.07958029955625534", "0.16093020141124725", "0.24611230194568634", "0.33791524171829224",
    "0.44070982933044434", "0.5626170039176941", "0.7229568362236023", "1.0")]
FP4_MAG = [literal32(s) for s in (
    "0.0", "0.005208333333", "0.66666667", "1.0", "0.33333333", "0.5", "0.16666667", "0.25")]
FP4 = [f32(FP4_MAG[c & 7] * (1.0 - 2 * ((c & 8) >> 3))) for c in range(16)]

# The decision trees as (threshold, code if above, code if not) nested tuples.
T = literal32
NF4_TREE = (T("0.03979014977812767"),
            (T("0.3893125355243683"),
             (T("0.6427869200706482"), (T("0.8614784181118011"), 15, 14),
              (T("0.5016634166240692"), 13, 12)),
             (T("0.2035212516784668"), (T("0.2920137718319893"), 11, 10),
              (T("0.1202552504837513"), 9, 8))),
            (T("-0.33967943489551544"),
             (T("-0.13791173323988914"), (T("-0.045525018125772476"), 7, 6),
              (T("-0.23460740596055984"), 5, 4)),
             (T("-0.6106329262256622"), (T("-0.4599952697753906"), 3, 2),
              (T("-0.8480964004993439"), 1, 0))))
FP4_TREE = (T("0.29166667"),
            (T("0.583333"), (T("0.8333333"), 3, 2), (T("0.4166667"), 5, 4)),
            (T("0.0859375"), (T("0.20833333"), 7, 6), (T("0.00260417"), 1, 0)))


def walk(tree, x):
    while isinstance(tree, tuple):
        t, above, below = tree
        tree = above if x > t else below  # NaN: never above
    return tree


def thresholds(tree):
    if not isinstance(tree, tuple):
        return []
    return [tree[0]] + thresholds(tree[1]) + thresholds(tree[2])


def code4(kind, x):
    if kind == "nf4":
        return walk(NF4_TREE, x)
    sign = 8 if x < 0 else 0
    return walk(FP4_TREE, abs(x)) + sign


def block_absmax(vals, partial):
    m = -3.4028234663852886e38  # -FLT_MAX; fmaxf skips NaN
    for v in vals:
        if not math.isnan(v):
            m = max(m, abs(v))
    return max(m, 0.0) if partial else m


def reciprocal(m):
    if m == 0:
        return math.inf
    if m == -3.4028234663852886e38:
        return f32(1.0 / m)
    return f32(1.0 / m)


def scaled(v, r):
    if math.isinf(r) and v == 0:
        return math.nan
    return f32(v * r)


def quantize4(kind, vals, blocksize):
    n = len(vals)
    codes, absmax = [], []
    for first in range(0, n, blocksize):
        block = vals[first:first + blocksize]
        m = f32(block_absmax(block, len(block) < blocksize))
        absmax.append(m)
        r = reciprocal(m)
        codes += [code4(kind, scaled(v, r)) for v in block]
    packed = bytearray((n + 1) // 2)
    for e, c in enumerate(codes):
        packed[e // 2] |= (c << 4) if e % 2 == 0 else c
    return bytes(packed), absmax


def dequantize4(kind, packed, absmax, blocksize, n):
    table = NF4 if kind == "nf4" else FP4
    out = []
    for e in range(n):
        byte = packed[e // 2]
        c = byte >> 4 if e % 2 == 0 else byte & 15
        out.append(f32(table[c] * absmax[e // blocksize]))
    return out


def linspace32(start, end, steps):
    """torch.linspace(start, end, steps, dtype=float32) as its CPU kernel computes one value:
    start + step·k below the halfway point, end − step·(steps − 1 − k) from it, each a fused
    multiply-add (one rounding: torch's CPU kernels are built with FMA contraction; checked
    against torch 2.11 on an AVX-512 host), step = (end − start) / (steps − 1) in fp32."""
    start, end = f32(start), f32(end)
    step = f32(f32(end - start) / f32(steps - 1))
    half = steps // 2
    F = fractions.Fraction
    return [f32_exact(F(start) + F(step) * k) if k < half
            else f32_exact(F(end) - F(step) * (steps - 1 - k)) for k in range(steps)]


def dynamic_map_plain():
    data = []
    for i in range(7):  # max_exponent_bits = 7, signed, total_bits = 8: no additional items
        b = linspace32(0.1, 1, 2 ** i + 1)
        means = [f32(f32(b[k] + b[k + 1]) / 2.0) for k in range(len(b) - 1)]
        scale = f32(10.0 ** (-6 + i))
        data += [f32(scale * m) for m in means]
        data += [f32(-scale * m) for m in means]
    data += [0.0, 1.0]
    return sorted(data)


def dynamic_map_torch():
    import torch
    data = []
    for i in range(7):
        b = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        means = (b[:-1] + b[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0, 1.0]
    data.sort()
    return torch.tensor(data, dtype=torch.float32).tolist()


def code8(table, x):
    """dQuantize<0> over the sorted 256-entry table."""
    pivot, upper_pivot, lower_pivot = 127, 255, 0
    lower, upper = -1.0, 1.0
    val = table[pivot]
    i = 64
    while i > 0:
        if x > val:
            lower_pivot, lower, pivot = pivot, val, pivot + i
        else:
            upper_pivot, upper, pivot = pivot, val, pivot - i
        val = table[pivot]
        i >>= 1
    if upper_pivot == 255:
        upper = table[upper_pivot]
    if lower_pivot == 0:
        lower = table[lower_pivot]
    if x > val:
        return upper_pivot if x > f32(f32(upper + val) * 0.5) else pivot
    return lower_pivot if x < f32(f32(lower + val) * 0.5) else pivot


def quantize8(table, vals, blocksize):
    codes, absmax = [], []
    for first in range(0, len(vals), blocksize):
        block = vals[first:first + blocksize]
        m = f32(block_absmax(block, len(block) < blocksize))
        absmax.append(m)
        r = reciprocal(m)
        codes += [code8(table, scaled(v, r)) for v in block]
    return codes, absmax


def dequantize8(table, codes, absmax, blocksize):
    return [f32(table[c] * absmax[e // blocksize]) for e, c in enumerate(codes)]


def boundary_values(kind):
    """Every threshold of the tree and its two fp32 neighbours, the code values, ±0."""
    ts = thresholds(NF4_TREE if kind == "nf4" else FP4_TREE)
    if kind == "fp4":
        ts = ts + [-t for t in ts]
    out = []
    for t in ts:
        out += [t, next_up(t), next_down(t)]
    out += NF4 if kind == "nf4" else FP4
    out += [0.0, -0.0, 1.0, -1.0]
    return out


def boundary_blocks(values, blocksize, scales):
    """Blocks of `values` (all |v| ≤ 1), each led by ±scale so that its absmax is the power of
    two `scale` and the scaled elements are the values exactly."""
    vals = []
    per = blocksize - 1
    for s in scales:
        for first in range(0, len(values), per):
            chunk = values[first:first + per]
            lead = s if len(vals) // blocksize % 2 == 0 else -s
            block = [lead] + [f32(v * s) for v in chunk]
            block += [0.0] * (blocksize - len(block))
            vals += block
    return vals


def case4(name, kind, blocksize, dtype, vals_bits, exact):
    if dtype == "fp32":
        vals = [from_bits32(b) for b in vals_bits]
    elif dtype == "bf16":
        vals = [bf16_to_f32(b) for b in vals_bits]
    else:
        vals = [f16_to_f32(b) for b in vals_bits]
    packed, absmax = quantize4(kind, vals, blocksize)
    deq = dequantize4(kind, packed, absmax, blocksize, len(vals))
    return {
        "name": name, "quant_type": kind, "blocksize": blocksize, "dtype": dtype,
        "gpu_exact": exact, "input_bits": vals_bits, "packed": packed.hex(),
        "absmax_bits": [bits32(a) for a in absmax],
        "dequantized_fp32_bits": [bits32(v) for v in deq],
        "dequantized_bf16_bits": [f32_to_bf16(v) for v in deq],
    }


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], data[a:b])
    return out


def write_safetensors(path, tensors):
    """tensors: name -> (dtype, shape, bytes), written in name order."""
    header, blobs, at = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def f32_bytes(values):
    return struct.pack("<%df" % len(values), *values)


def write_bnb_folder(src, out, kind, double):
    """A model folder as transformers saves a bnb-4bit model (QuantState.as_dict(packed=True)):
    every decoder projection's weight quantized with blocks of 64, the rest as in `src`, and
    expected.safetensors with each projection's dequantized fp32 values."""
    os.makedirs(out, exist_ok=True)
    tensors, expected = {}, {}
    table = dynamic_map_plain()
    for name, (dtype, shape, raw) in read_safetensors(os.path.join(src, "model.safetensors")).items():
        if not (".layers." in name and name.endswith("_proj.weight")):
            tensors[name] = (dtype, shape, raw)
            continue
        assert dtype == "F32"
        vals = list(struct.unpack("<%df" % (len(raw) // 4), raw))
        packed, absmax = quantize4(kind, vals, 64)
        tensors[name] = ("U8", [len(packed), 1], packed)
        tensors[name + ".quant_map"] = ("F32", [16], f32_bytes(NF4 if kind == "nf4" else
                                                              [f32(v / 12.0) for v in (0, 0.0625, 8, 12, 4, 6, 2, 3, 0, -0.0625, -8, -12, -4, -6, -2, -3)]))
        state = {"quant_type": kind, "blocksize": 64, "dtype": "float32", "shape": shape}
        scales = absmax
        if double:
            offset = f32(math.fsum(absmax) / len(absmax))
            codes, nested = quantize8(table, [f32(a - offset) for a in absmax], 256)
            tensors[name + ".absmax"] = ("U8", [len(codes)], bytes(codes))
            tensors[name + ".nested_absmax"] = ("F32", [len(nested)], f32_bytes(nested))
            tensors[name + ".nested_quant_map"] = ("F32", [256], f32_bytes(table))
            state.update({"nested_blocksize": 256, "nested_dtype": "float32",
                          "nested_offset": offset})
            scales = [f32(v + offset) for v in dequantize8(table, codes, nested, 256)]
        else:
            tensors[name + ".absmax"] = ("F32", [len(absmax)], f32_bytes(absmax))
        packed_state = json.dumps(state).encode()
        tensors[name + ".quant_state.bitsandbytes__" + kind] = ("U8", [len(packed_state)],
                                                               packed_state)
        deq = dequantize4(kind, packed, scales, 64, len(vals))
        expected[name] = ("F32", shape, f32_bytes(deq))
    write_safetensors(os.path.join(out, "model.safetensors"), tensors)
    write_safetensors(os.path.join(out, "expected.safetensors"), expected)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
        "bnb_4bit_quant_type": kind, "bnb_4bit_use_double_quant": double,
        "bnb_4bit_compute_dtype": "float32", "bnb_4bit_quant_storage": "uint8",
        "llm_int8_threshold": 6.0, "llm_int8_skip_modules": None,
        "llm_int8_has_fp16_weight": False, "llm_int8_enable_fp32_cpu_offload": False,
        "_load_in_4bit": True, "_load_in_8bit": False}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def main():
    if sys.argv[1] == "folder":  # folder SRC OUT nf4|fp4 double|single
        write_bnb_folder(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "double")
        return
    out_path = sys.argv[1]
    rng = random.Random(1234)
    table = dynamic_map_plain()
    try:
        torch_bits = [bits32(v) for v in dynamic_map_torch()]
        map_source = "plain, equal to this machine's torch"
    except ImportError:
        # Without torch: the map torch 2.11 computed on the GPU machine, kept as a fixture.
        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, "../fixtures/quant/torch_dynamic_map.json")) as f:
            saved = json.load(f)
        torch_bits = saved["dynamic_map_bits"]
        map_source = "plain, equal to " + saved["origin"].split(":")[0]
    if torch_bits != [bits32(v) for v in table]:
        sys.exit("the plain dynamic map differs from torch's: fix linspace32")

    cases = []
    for kind in ("nf4", "fp4"):
        values = boundary_values(kind)
        for blocksize in (32, 64, 4096):
            scales = [1.0, 0.125, 64.0, 2.0 ** -20] if blocksize < 4096 else [1.0, 2.0 ** -20]
            vals = boundary_blocks(values, blocksize, scales)
            cases.append(case4(f"{kind} thresholds, blocks of {blocksize}", kind, blocksize,
                               "fp32", [bits32(v) for v in vals], True))
        # Scales that are not powers of two: IEEE reciprocal (the GPU's may differ in a code).
        vals = [f32(rng.gauss(0, 0.02)) for _ in range(64 * 12 + 37)]  # odd: a partial block
        cases.append(case4(f"{kind} normal weights, partial last block", kind, 64, "fp32",
                           [bits32(v) for v in vals], False))
        # An all-zero block (NaN scaled values) between two ordinary ones, and a negative block.
        vals = [0.5] * 64 + [0.0] * 64 + [-0.25, -0.0] * 32 + [-3.0] * 64
        cases.append(case4(f"{kind} zero and negative blocks", kind, 64, "fp32",
                           [bits32(f32(v)) for v in vals], True))
        for dtype, conv in (("bf16", f32_to_bf16), ("fp16", f32_to_f16)):
            vals = [conv(rng.gauss(0, 1.0)) for _ in range(128 * 5)]
            cases.append(case4(f"{kind} {dtype} values, blocks of 128", kind, 128, dtype, vals,
                               False))

    # 8-bit dynamic codes: every midpoint the search compares against and its neighbours.
    mids = []
    for k in range(255):
        m = f32(f32(table[k] + table[k + 1]) * 0.5)
        mids += [m, next_up(m), next_down(m), table[k]]
    mids += [table[255]]
    mids = [v for v in mids if abs(v) <= 1.0]
    vals8 = boundary_blocks(mids, 256, [1.0, 0.0078125])
    codes, absmax = quantize8(table, vals8, 256)
    eight = {
        "name": "dynamic map midpoints, blocks of 256", "blocksize": 256,
        "input_bits": [bits32(v) for v in vals8], "codes": codes,
        "absmax_bits": [bits32(a) for a in absmax],
        "dequantized_bits": [bits32(v) for v in dequantize8(table, codes, absmax, 256)],
    }
    # Double quantization of a 4-bit absmax: offset = their mean (bitsandbytes takes torch's mean
    # on the device, whose summation order is its own: the offset is given, not compared).
    absmax4 = [f32(abs(rng.gauss(0, 0.05)) + 0.01) for _ in range(700)]
    offset = f32(math.fsum(absmax4) / len(absmax4))
    centred = [f32(a - offset) for a in absmax4]
    dq_codes, dq_absmax = quantize8(table, centred, 256)
    dq_back = [f32(v + offset) for v in dequantize8(table, dq_codes, dq_absmax, 256)]
    double = {
        "absmax_bits": [bits32(a) for a in absmax4], "offset_bits": bits32(offset),
        "codes": dq_codes, "nested_absmax_bits": [bits32(a) for a in dq_absmax],
        "absmax_back_bits": [bits32(v) for v in dq_back],
    }
    doc = {
        "origin": "tests/tools/bnb_reference.py: bitsandbytes 95f9af3's algorithm in plain Python",
        "dynamic_map_source": map_source,
        "dynamic_map_bits": [bits32(v) for v in table],
        "nf4_quant_map_bits": [bits32(v) for v in NF4],
        "fp4_quant_map_bits": [bits32(f32(v / 12.0)) for v in
                               (0, 0.0625, 8, 12, 4, 6, 2, 3, 0, -0.0625, -8, -12, -4, -6, -2, -3)],
        "four_bit": cases, "eight_bit": eight, "double_quant": double,
    }
    with open(out_path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
