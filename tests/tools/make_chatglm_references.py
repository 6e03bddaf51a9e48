#!/usr/bin/env python3
"""ChatGLM references made by THUDM's and ChatGLM-Finetuning's own code, for CI to check
zerotrain against without them:

    python3 tests/tools/make_chatglm_references.py REMOTE_DIR SEED_UTILS TOKENIZER OUT_DIR

REMOTE_DIR     ChatGLM3's remote code (tokenization_chatglm.py), e.g. ChatGLM-Finetuning's glm3/
SEED_UTILS     ChatGLM-Finetuning's utils.py (GLM2PromptDataSet, GLM3PromptDataSet)
TOKENIZER      a SentencePiece tokenizer.model (tests/fixtures/models/chatglm's tiny one)
OUT_DIR        gets tokenizer_cases.jsonl, seed_records.jsonl and seed_<mode>_<max_len>_<max_src_len>.jsonl

Only Python's sentencepiece is needed (Debian's python3-sentencepiece): the code's torch and
transformers imports are stubbed, and the tokenizer wrapper's few methods the dataset classes
call are given as tokenization_chatglm.py's ChatGLMTokenizer defines them (tokenize ->
SPTokenizer.tokenize, _convert_token_to_id, get_command, encode(add_special_tokens=False)).
"""
import importlib.util
import json
import os
import sys
import types

REMOTE, SEED_UTILS, TOKENIZER, OUT = sys.argv[1:5]


def stub(name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m


class _Any:
    def __init__(self, *a, **k):
        pass


logging = types.SimpleNamespace(get_logger=lambda *a: types.SimpleNamespace(warning=print))
stub("transformers", PreTrainedTokenizer=_Any, set_seed=lambda s: None)
stub("transformers.utils", logging=logging,
     PaddingStrategy=types.SimpleNamespace(DO_NOT_PAD="do_not_pad", LONGEST="longest"))
stub("transformers.tokenization_utils_base", EncodedInput=list, BatchEncoding=dict)
torch = stub("torch", tensor=lambda *a, **k: None, long=None, manual_seed=lambda s: None,
             cuda=types.SimpleNamespace(manual_seed_all=lambda s: None))
stub("torch.utils")
stub("torch.utils.data", Dataset=object)
stub("numpy", random=types.SimpleNamespace(seed=lambda s: None))


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


tok_mod = load(os.path.join(REMOTE, "tokenization_chatglm.py"), "tokenization_chatglm")
sp = tok_mod.SPTokenizer(TOKENIZER)


class Wrapper:
    """The ChatGLM3 tokenizer wrapper's methods that data_set.py calls."""
    eos_token_id = 2

    def tokenize(self, text):
        return sp.tokenize(text)

    def get_command(self, token):
        special = {"<bos>": sp.bos_id, "<eos>": sp.eos_id, "<pad>": sp.pad_id}
        return special[token] if token in special else sp.special_tokens[token]

    def convert_tokens_to_ids(self, tokens):
        return [sp.convert_token_to_id(t) for t in tokens]

    def encode(self, text, add_special_tokens=True):
        ids = self.convert_tokens_to_ids(self.tokenize(text))
        return ([self.get_command("[gMASK]"), self.get_command("sop")] + ids) if add_special_tokens else ids


TEXTS = ["", "你好", "Hello world", "  two leading spaces", "tabs\tand\nnewlines\n\n", "trailing  ",
         "def f(x):\n    return x * 2  # double\n", "数字 12345 和 3.14159", "混合 text 和 English!",
         "emoji 🙂 and 𠮷", "[gMASK]sop literal", "<|user|>\n hi<|assistant|> ok", "sophisticated",
         "[gMASK]sopx", "a\u2581b", "全角ＡＢＣ", "line one\nline two\r\nthree"]

os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, "tokenizer_cases.jsonl"), "w", encoding="utf-8") as f:
    for t in TEXTS:
        ids = sp.encode(t)
        f.write(json.dumps({"text": t, "ids": ids, "pieces": sp.tokenize(t),
                            "role_split_ids": [sp.convert_token_to_id(p) for p in
                                               sp.tokenize(t, encode_special_tokens=True)],
                            "decoded": sp.decode(ids)}, ensure_ascii=False) + "\n")

RECORDS = [
    {"instruction": "你好", "input": "", "output": "你好，我是一个语言模型。"},
    {"instruction": "Translate: ", "input": "The quick brown fox", "output": "敏捷的棕色狐狸"},
    {"instruction": "def add(a, b):\n    return a + b\n" * 6, "input": "请解释", "output": "这个函数把两个数相加。" * 8},
    {"instruction": "短", "input": "", "output": "The quick brown fox jumps over the lazy dog. " * 10},
]
with open(os.path.join(OUT, "seed_records.jsonl"), "w", encoding="utf-8") as f:
    for r in RECORDS:
        f.write(json.dumps(r, ensure_ascii=False) + "\n")

seed = load(SEED_UTILS, "seed_utils")
for mode, cls in (("glm2", seed.GLM2PromptDataSet), ("glm3", seed.GLM3PromptDataSet)):
    for max_len, max_src in ((1024, 256), (48, 16), (40, 24)):
        for skip in (False, True):
            ds = cls(os.path.join(OUT, "seed_records.jsonl"), Wrapper(), max_len, max_src, skip)
            name = f"seed_{mode}_{max_len}_{max_src}{'_skip' if skip else ''}.jsonl"
            with open(os.path.join(OUT, name), "w") as f:
                for ex in ds.all_data:
                    f.write(json.dumps(ex) + "\n")
print("wrote", OUT)
