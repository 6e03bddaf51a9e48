#!/usr/bin/env python3
"""The long-context ladder for the peer: one LoRA step at micro-batch 1 with checkpointing per
sequence length, stopping at the first that fails (out of memory), through the peer script's own
run() (shared/bench/hf_baseline.py, its copy in .peer/).

    python3 bench/tools/peer_ladder.py .peer/hf_baseline.py SHAPE SEQ [SEQ ...]

Prints one `RESULT {json}` per length tried (`error` set on the one that failed).
"""
import importlib.util
import json
import sys

import torch

peer_path, shape, *lengths = sys.argv[1:]
spec = importlib.util.spec_from_file_location("hf_baseline", peer_path)
peer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peer)
for seq in map(int, lengths):
    try:
        r = peer.run(shape, "lora", seq, 1, True, steps=1, warm=1)
    except torch.OutOfMemoryError:
        r = dict(shape=shape, mode="lora", seq=seq, mbs=1, ckpt=True, error="OOM")
    except Exception as e:  # noqa: BLE001 - reported, then the ladder stops
        r = dict(shape=shape, mode="lora", seq=seq, mbs=1, ckpt=True, error=repr(e)[:300])
    print("RESULT " + json.dumps(r), flush=True)
    torch.cuda.empty_cache()
    if "error" in r:
        break
