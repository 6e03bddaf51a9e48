#!/usr/bin/env python3
"""Generation reference fixtures made by transformers' own `generate`, committed as
tests/fixtures/generation/*.json and checked by tests/test_generation.cpp in CI.

    python3 tests/tools/make_generation_fixtures.py OUT_DIR

For the committed tiny model tests/fixtures/models/llama (fp32, CPU) and prompts of different
lengths (left-padded as transformers batches them, pad id 0):
  greedy.json    per case (max_new_tokens, eos ids, repetition_penalty): the prompts and the
                 new tokens of every row, up to its first eos (transformers pads rows that
                 finished early; the fixture drops that padding)
  sampling.json  per case (temperature, top_k, top_p, min_p, repetition_penalty), per step:
                 the raw logits (output_logits) of every row, the tokens so far (prompt without
                 padding + new tokens), and the scores after transformers' logits processors
                 (output_scores: -inf where a token was filtered out), the values sampling draws
                 from
"""
import json
import math
import os
import sys

import torch
from transformers import AutoModelForCausalLM

OUT = sys.argv[1]
os.makedirs(OUT, exist_ok=True)
MODEL = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures",
                                      "models", "llama"))
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
vocab = model.config.vocab_size

PROMPTS = [[1, 17, 33, 90, 5, 64, 12], [1, 44], [1, 3, 99, 120, 7], [1, 70, 71, 72, 73, 74, 75, 76, 77, 5]]


def batch(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask, width


def finite(values):
    # fp32 values, exactly (9 significant digits); -inf as null.
    return [[float(f"{v:.9g}") if math.isfinite(v) else None for v in row] for row in values]


greedy = []
for name, new, eos, penalty in [("plain", 12, [], 1.0), ("eos", 16, [104, 99], 1.0),
                                ("repetition", 12, [], 1.3), ("repetition_low", 10, [], 0.8)]:
    ids, mask, width = batch(PROMPTS)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                         eos_token_id=eos or None, pad_token_id=0, repetition_penalty=penalty,
                         min_new_tokens=0, num_beams=1)
    rows = []
    for r in out[:, width:].tolist():
        cut = []
        for t in r:
            cut.append(t)
            if t in eos:
                break
        rows.append(cut)
    greedy.append(dict(name=name, max_new_tokens=new, eos_token_ids=eos, repetition_penalty=penalty,
                       prompts=PROMPTS, completions=rows))

sampling = []
for name, cfg in [("temperature", dict(temperature=0.7)),
                  ("top_k", dict(temperature=1.3, top_k=5)),
                  ("top_p", dict(temperature=0.9, top_p=0.8)),
                  ("min_p", dict(temperature=1.0, min_p=0.05)),
                  ("all", dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02,
                               repetition_penalty=1.2)),
                  ("repetition", dict(temperature=1.0, repetition_penalty=0.7, top_k=40))]:
    full = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0)
    full.update(cfg)
    ids, mask, width = batch(PROMPTS)
    torch.manual_seed(1)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=True,
                         pad_token_id=0, output_logits=True, output_scores=True,
                         return_dict_in_generate=True, temperature=full["temperature"],
                         top_k=full["top_k"], top_p=full["top_p"], min_p=full["min_p"],
                         repetition_penalty=full["repetition_penalty"])
    seq = out.sequences
    steps = []
    for s, (raw, scores) in enumerate(zip(out.logits, out.scores)):
        history = [p + seq[i, width:width + s].tolist() for i, p in enumerate(PROMPTS)]
        steps.append(dict(history=history, logits=finite(raw.tolist()), scores=finite(scores.tolist())))
    sampling.append(dict(name=name, options=full, steps=steps))

import transformers

with open(os.path.join(OUT, "greedy.json"), "w") as f:
    json.dump(dict(transformers=transformers.__version__, cases=greedy), f)
with open(os.path.join(OUT, "sampling.json"), "w") as f:
    json.dump(dict(transformers=transformers.__version__, cases=sampling), f)
print(f"wrote {len(greedy)} greedy and {len(sampling)} sampling cases")
