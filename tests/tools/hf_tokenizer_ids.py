#!/usr/bin/env python3
"""Ids that HF's own tokenizers give for a corpus, the reference for zerotrain's encoder on real
tokenizer files (run where `tokenizers` and `transformers` are installed: the GPU machine).

    python3 tests/tools/hf_tokenizer_ids.py REAL_DIR CORPUS.jsonl OUT_DIR NAME...

REAL_DIR/<NAME>/ holds tokenizer.json and tokenizer_config.json (tests/tools/
fetch_real_tokenizers.sh); CORPUS.jsonl has {"text": ...} lines. Writes, in the format the
"tool: real tokenizer folders against reference ids" test reads ({"<NAME>": [[ids], ...] |
{"error": "..."}}):
  OUT_DIR/tokenizers.json    the tokenizer.json pipeline alone (tokenizers.Tokenizer.from_file)
  OUT_DIR/transformers.json  AutoTokenizer.from_pretrained(folder), as a user's script encodes
and OUT_DIR/classes.json: the class transformers picked per folder and where the two differ.
"""
import json
import os
import sys

import tokenizers
import transformers
from transformers import AutoTokenizer

real, corpus, out, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
os.makedirs(out, exist_ok=True)
texts = [json.loads(l)["text"] for l in open(corpus, encoding="utf-8") if l.strip()]
raw, hf, classes = {}, {}, {"versions": {"tokenizers": tokenizers.__version__,
                                         "transformers": transformers.__version__}}
for name in names:
    d = os.path.join(real, name)
    try:
        t = tokenizers.Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        # The file's truncation / padding (T5's and some BERTs' carry them) are per-call settings
        # in transformers and the data pipeline's job in zerotrain (docs/tokenizers.md): off.
        t.no_truncation()
        t.no_padding()
        raw[name] = [t.encode(x, add_special_tokens=False).ids for x in texts]
    except Exception as e:  # noqa: BLE001 - the file says what failed
        raw[name] = {"error": f"{type(e).__name__}: {e}"}
    try:
        a = AutoTokenizer.from_pretrained(d)
        hf[name] = [a(x, add_special_tokens=False)["input_ids"] for x in texts]
        differs = [i for i, (p, q) in enumerate(zip(hf[name], raw[name])) if p != q] \
            if isinstance(raw[name], list) else None
        classes[name] = {"class": type(a).__name__, "texts_differing_from_tokenizers": differs}
    except Exception as e:  # noqa: BLE001
        hf[name] = {"error": f"{type(e).__name__}: {e}"}
        classes[name] = {"error": hf[name]["error"]}
    print(name, classes[name], flush=True)
for file, value in (("tokenizers.json", raw), ("transformers.json", hf), ("classes.json", classes)):
    with open(os.path.join(out, file), "w") as f:
        json.dump(value, f)
