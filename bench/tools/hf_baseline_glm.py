#!/usr/bin/env python3
"""The HF + PEFT peer (shared/bench/hf_baseline.py, carried as .peer/hf_baseline.py) with the
GLM-4-9B shape (transformers' `glm`, THUDM/glm-4-9b-chat-hf) added: the peer script knows only
Qwen2 / LLaMA shapes and their module names. This reads the peer's own file, adds the shape and
LoRA on GLM's module names (q/k/v/o_proj, gate_up_proj, down_proj), and runs it unchanged
otherwise, so both sides of a comparison time the same loop.

    python3 bench/tools/hf_baseline_glm.py PEER.py glm-4-9b lora 1024 8 0
"""
import sys

GLM_SHAPE = '''    "glm-4-9b": dict(hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
                     num_attention_heads=32, num_key_value_heads=2, head_dim=128,
                     partial_rotary_factor=0.5, attention_bias=True, vocab_size=151552,
                     tie_word_embeddings=False, rope_theta=1e4, max_position_embeddings=131072,
                     pad_token_id=151329, eos_token_id=[151329, 151336, 151338]),
'''
LLAMA_TARGETS = '["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]'
GLM_TARGETS = '["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]'
ARCH = 'arch = "qwen2" if shape.startswith("qwen") else "llama"'


def main():
    peer = sys.argv.pop(1)
    src = open(peer, encoding="utf-8").read()
    for anchor in ("SHAPES = {\n", ARCH, LLAMA_TARGETS):
        if anchor not in src:
            sys.exit(f"{peer}: no '{anchor.strip()}' to extend (the peer script changed)")
    src = src.replace("SHAPES = {\n", "SHAPES = {\n" + GLM_SHAPE, 1)
    src = src.replace(ARCH, 'arch = "glm" if shape.startswith("glm") else "qwen2" '
                            'if shape.startswith("qwen") else "llama"', 1)
    src = src.replace(LLAMA_TARGETS, f'({GLM_TARGETS} if arch == "glm" else {LLAMA_TARGETS})', 1)
    exec(compile(src, peer, "exec"), {"__name__": "__main__"})


if __name__ == "__main__":
    main()
