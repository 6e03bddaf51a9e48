#!/usr/bin/env python3
"""Reference fixtures from the Hugging Face stack, made on the GPU machine (transformers 5.x,
PEFT, tokenizers, safetensors), committed under tests/fixtures/ and checked by CI without them.

    python3 tests/tools/make_fixtures.py OUT_DIR [models] [families] [peft] [variants] [tokenizers]

models/     tiny random llama (plain, llama3 and linear RoPE scaling), qwen2 (q/k/v bias, tied
            embeddings, also saved sharded), mistral, glm and glm4 (partial interleaved RoPE,
            fused gate_up_proj; glm4's post-sublayer norms) checkpoints as save_pretrained writes
            them, plus config_v4.json in the older key spelling, and expected.safetensors:
            logits, per-layer hidden states, the loss and a few gradients for fixed inputs.
families    (models/ too) the families of [1/7]: qwen3 (q/k norms; yarn RoPE), mistral with head_dim,
            gemma2, gemma3_text, phi3 (fused projections; partial rotary with LongRoPE, short
            and long), llama with yarn (DeepSeek's members) and dynamic RoPE; see
            FAMILY_MODELS (FAMILIES=a,b makes only those).
peft/       adapters PEFT creates on the tiny llama (LoRA, rsLoRA on all linear layers,
            P-Tuning with MLP and LSTM encoders, prefix tuning with and without projection),
            with the logits and loss they give and PEFT's trainable-parameter counts.
experts     LoRA on the MoE fixtures' fused expert tensors through PEFT's target_parameters
            (peft/experts_*), with the attention's target_modules.
multimodal  models/gemma3, models/gemma3_new_names: Gemma 3 as published, with its vision tower
            (model_type gemma3), and what transformers computes of text alone.
mistral3    models/mistral3: Mistral-Small-3.1 / 3.2 as published (Mistral3ForConditionalGeneration
            with a Pixtral tower), and what transformers computes of text alone.
mxfp4       models/gpt_oss_mxfp4: gpt-oss's experts stored as released (MXFP4 blocks and
            scales) and what transformers' Mxfp4Config(dequantize=True) makes of them.
variants:   DoRA (llama; qwen2 all-linear with rsLoRA) and PiSSA (llama, with its pissa_init and
            pissa_converted folders) adapters PEFT made, with where they started, their logits,
            loss and one backward's gradients (peft/dora_*, peft/pissa_*).
tokenizer_models (tokenizers/ too, only when named) Unigram, WordPiece, WordLevel and BPE with
            subword prefix / suffix tokenizers with the other normalizers, pre-tokenizers,
            post-processors and decoders (make_tokenizer_models).
tokenizers/ small BPE tokenizers trained with the pipelines of Qwen2 (byte-level, digits one
            by one), LLaMA-3 (digits in threes), LLaMA-2 (normalizer ▁ + byte fallback) and
            Mistral (Metaspace pre-tokenizer), with the ids HF produces for a varied text set.
Everything is computed in fp32 on the CPU so the numbers are deterministic.
"""
import json
import os
import sys
import traceback

import torch

OUT = sys.argv[1]
WHAT = set(sys.argv[2:]) or {"models", "families", "peft", "variants", "tokenizers"}
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
torch.set_num_threads(4)


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)
        f.write("\n")


def inputs(vocab):
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, vocab, (2, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0  # right padding on the second row
    labels = ids.clone()
    labels[0, :3] = -100  # a "prompt"
    labels[mask == 0] = -100
    return ids, mask, labels


TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-6)

MODELS = {
    "llama": ("llama", dict(TINY, rope_theta=10000.0, tie_word_embeddings=False)),
    "llama_rope_llama3": ("llama", dict(TINY, rope_theta=500000.0, tie_word_embeddings=False,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                      "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 32})),
    "llama_rope_linear": ("llama", dict(TINY, rope_theta=10000.0, tie_word_embeddings=False,
                                        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2": ("qwen2", dict(TINY, rope_theta=1000000.0, tie_word_embeddings=True,
                            use_sliding_window=False)),
    "mistral": ("mistral", dict(TINY, rope_theta=10000.0, tie_word_embeddings=False,
                                sliding_window=None)),
    # GLM: head_dim given (GlmConfig's default is 128), RoPE on half of it, interleaved; token
    # ids inside the tiny vocabulary.
    "glm": ("glm", dict(TINY, head_dim=16, rope_theta=10000.0, partial_rotary_factor=0.5,
                        attention_bias=True, tie_word_embeddings=False, pad_token_id=0,
                        eos_token_id=[1, 2], bos_token_id=None)),
    "glm4": ("glm4", dict(TINY, head_dim=16, rope_theta=10000.0, partial_rotary_factor=0.5,
                          attention_bias=True, tie_word_embeddings=False, pad_token_id=0,
                          eos_token_id=[1, 2], bos_token_id=None)),
}


# The families of [1/7] (made with `families`): what each adds to the shared decoder, in tiny
# sizes where every switch matters over 16 tokens (a window of 4, soft-caps the logits reach).
FAMILY_MODELS = {
    # q/k RMSNorm per head; head_dim given, not hidden / heads.
    "qwen3": ("qwen3", dict(TINY, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False,
                            attention_bias=False)),
    # yarn as Qwen3's model card sets it; max / original positions (8) differ from the factor
    # (4), so a reader that derives one from the other is caught.
    "qwen3_rope_yarn": ("qwen3", dict(TINY, head_dim=16, rope_theta=1000000.0,
                                      tie_word_embeddings=True,
                                      rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 16})),
    # yarn as DeepSeek and gpt-oss set it: its own betas, mscale / mscale_all_dim, untruncated.
    "llama_rope_yarn": ("llama", dict(TINY, rope_theta=10000.0, tie_word_embeddings=False,
                                      rope_scaling={"rope_type": "yarn", "factor": 8.0,
                                                    "original_max_position_embeddings": 16,
                                                    "beta_fast": 8.0, "beta_slow": 0.5,
                                                    "mscale": 1.0, "mscale_all_dim": 0.8,
                                                    "truncate": False})),
    # dynamic NTK: 16 positions beyond max_position_embeddings 8 grow the base.
    "llama_rope_dynamic": ("llama", dict(TINY, rope_theta=10000.0, tie_word_embeddings=False,
                                         max_position_embeddings=8,
                                         rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    # Mistral-Nemo / Small 3: head_dim given (128 with hidden 5120 / 32 heads).
    "mistral_head_dim": ("mistral", dict(TINY, head_dim=32, rope_theta=1000000.0,
                                         tie_word_embeddings=False, sliding_window=None)),
    # Gemma 2: GeGLU (gelu_pytorch_tanh), (1 + w) norms, four norms per layer, embeddings × √H,
    # query_pre_attn_scalar, attention and final soft-caps, sliding (even) and global (odd) layers.
    "gemma2": ("gemma2", dict(TINY, head_dim=16, rope_theta=10000.0, query_pre_attn_scalar=24,
                              attn_logit_softcapping=2.0, final_logit_softcapping=1.5,
                              sliding_window=4, hidden_activation="gelu_pytorch_tanh",
                              tie_word_embeddings=True, pad_token_id=0, eos_token_id=1,
                              bos_token_id=2)),
    # Gemma 3: Gemma 2's blocks with q/k norms and no soft-caps; 5 local : 1 global with their
    # own RoPE bases, linear scaling on the global layers.
    "gemma3_text": ("gemma3_text", dict(TINY, num_hidden_layers=6, head_dim=16,
                                        rope_theta=1000000.0, rope_local_base_freq=10000.0,
                                        rope_scaling={"rope_type": "linear", "factor": 8.0},
                                        query_pre_attn_scalar=16, sliding_window=4,
                                        sliding_window_pattern=6,
                                        hidden_activation="gelu_pytorch_tanh",
                                        tie_word_embeddings=True, pad_token_id=0, eos_token_id=1,
                                        bos_token_id=2)),
    # Phi-3: fused qkv_proj and gate_up_proj.
    "phi3": ("phi3", dict(TINY, rope_theta=10000.0, tie_word_embeddings=False, pad_token_id=0,
                          eos_token_id=1, bos_token_id=2, sliding_window=None)),
    # Phi-4-mini: partial rotary (0.75), LongRoPE short/long factors (rotary_dim / 2 each).
    "phi3_longrope": ("phi3", dict(TINY, rope_theta=10000.0, tie_word_embeddings=True,
                                   partial_rotary_factor=0.75, pad_token_id=0, eos_token_id=1,
                                   bos_token_id=2, sliding_window=None,
                                   original_max_position_embeddings=32,
                                   rope_scaling={"rope_type": "longrope",
                                                 "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                                 "long_factor": [1.5 + 0.2 * i for i in range(6)]})),
    # The same beyond its original 8 positions: the long factors, and the attention factor of
    # max / original = 16.
    "phi3_longrope_long": ("phi3", dict(TINY, rope_theta=10000.0, tie_word_embeddings=True,
                                        partial_rotary_factor=0.75, pad_token_id=0,
                                        eos_token_id=1, bos_token_id=2, sliding_window=None,
                                        original_max_position_embeddings=8,
                                        rope_scaling={"rope_type": "longrope",
                                                      "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                                      "long_factor": [1.5 + 0.2 * i for i in range(6)]})),
    # Qwen3-MoE: Qwen3's attention, 4 experts of which each token takes 2 (renormalized), the
    # middle layer dense (mlp_only_layers).
    "qwen3_moe": ("qwen3_moe", dict(TINY, num_hidden_layers=3, head_dim=32, rope_theta=1000000.0,
                                    tie_word_embeddings=False, num_experts=4,
                                    num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True, mlp_only_layers=[1],
                                    decoder_sparse_step=1)),
    # Mixtral: Mistral's attention, 4 experts of intermediate_size in every layer, top 2
    # renormalized.
    "mixtral": ("mixtral", dict(TINY, intermediate_size=48, head_dim=16, rope_theta=1000000.0,
                                tie_word_embeddings=False, num_local_experts=4,
                                num_experts_per_tok=2, sliding_window=None, bos_token_id=1,
                                eos_token_id=2)),
    # gpt-oss: attention sinks and biases, sliding (window 4) and full layers alternating, yarn
    # RoPE, 4 experts of which each token takes 2 (softmax over the chosen logits), router and
    # expert biases, the clamped SwiGLU (alpha 1.702, limit swiglu_limit).
    "gpt_oss": ("gpt_oss", dict(TINY, num_hidden_layers=2, intermediate_size=32, head_dim=16,
                                rope_theta=150000.0, tie_word_embeddings=False,
                                num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                                layer_types=["sliding_attention", "full_attention"],
                                swiglu_limit=7.0, attention_bias=True,
                                rope_scaling={"rope_type": "yarn", "factor": 32.0,
                                              "beta_fast": 32.0, "beta_slow": 1.0,
                                              "truncate": False,
                                              "original_max_position_embeddings": 4096})),
    # GLM-4.5: the first layer dense, then 4 routed experts (sigmoid scores with
    # e_score_correction_bias, grouped top-2 of 2 groups) and one shared expert,
    # routed_scaling_factor, partial RoPE, q/k norms off.
    "glm4_moe": ("glm4_moe", dict(TINY, num_hidden_layers=2, head_dim=16, rope_theta=10000.0,
                                  partial_rotary_factor=0.5, attention_bias=True,
                                  tie_word_embeddings=False, moe_intermediate_size=32,
                                  n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                  n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                  norm_topk_prob=True, first_k_dense_replace=1,
                                  use_qk_norm=False, pad_token_id=0, eos_token_id=[1, 2],
                                  bos_token_id=None)),
}


def build(kind, kwargs, seed):
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    kwargs = dict(kwargs)
    if kind in ("gemma3_text", "phi3"):
        pass  # their own RoPE keys: given in the 4.x spelling, which 5.x still converts
    elif int(transformers.__version__.split(".")[0]) >= 5:
        # transformers 5 keeps RoPE settings in one rope_parameters dict.
        rope = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta")}
        scaling = kwargs.pop("rope_scaling", None)
        if scaling:
            rope.update(scaling)
        kwargs["rope_parameters"] = rope
    cfg = AutoConfig.for_model(kind, **kwargs)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    except TypeError:
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    # Non-trivial norms and biases, so a loader that skips them is caught.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn_like(p))
            elif (name.endswith("mlp.gate.weight") or name.endswith("mlp.router.weight") or
                  ".experts." in name):
                # Routers far from ties (transformers starts them at zero) and experts that
                # differ, so a wrong choice of experts shows.
                p.normal_(0.0, 0.3 if name.endswith(("gate.weight", "router.weight")) else 0.05)
            elif name.endswith(("router.bias", "self_attn.sinks")):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # GLM-4.5's, a buffer there
                b.normal_(0.0, 0.1)
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):  # a parameter in other versions
                p.normal_(0.0, 0.1)
    return model


def old_spelling(config):
    """transformers 4.x spelling: torch_dtype, rope_theta, rope_scaling."""
    c = dict(config)
    if "dtype" in c:
        c["torch_dtype"] = c.pop("dtype")
    rp = c.pop("rope_parameters", None)
    if rp is not None and "full_attention" in rp:
        # Gemma 3: one set per layer type; 4.x keeps the local base as rope_local_base_freq.
        c["rope_local_base_freq"] = rp["sliding_attention"]["rope_theta"]
        rp = rp["full_attention"]
    if rp is not None:
        rp = dict(rp)
        c["rope_theta"] = rp.pop("rope_theta")
        if "partial_rotary_factor" in rp:  # 4.x keeps it at the top (GLM)
            c["partial_rotary_factor"] = rp.pop("partial_rotary_factor")
        if rp.get("rope_type", "default") != "default":
            rp["type"] = rp["rope_type"]
            c["rope_scaling"] = rp
        else:
            c["rope_scaling"] = None
    return c


def make_models(models=MODELS):
    from safetensors.torch import save_file
    root = os.path.join(OUT, "models")
    for name, (kind, kwargs) in models.items():
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        model = build(kind, kwargs, seed=sum(map(ord, name)))
        model.save_pretrained(d, safe_serialization=True)
        with open(os.path.join(d, "config.json")) as f:
            write_json(os.path.join(d, "config_v4.json"), old_spelling(json.load(f)))
        ids, mask, labels = inputs(kwargs["vocab_size"])
        model.train()
        out = model(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True)
        out.loss.backward()
        expected = {"input_ids": ids, "attention_mask": mask, "labels": labels,
                    "logits": out.logits.detach(), "loss": out.loss.detach().reshape(1)}
        for i, h in enumerate(out.hidden_states):
            expected[f"hidden_states.{i}"] = h.detach()
        for pname, p in model.named_parameters():
            if any(k in pname for k in ("embed_tokens", "layers.0.self_attn.q_proj",
                                         "layers.1.mlp.down_proj", "model.norm", "lm_head",
                                         "layers.0.self_attn.k_proj.bias",
                                         "layers.0.mlp.gate_up_proj",
                                         "layers.1.post_self_attn_layernorm",
                                         "layers.1.post_mlp_layernorm",
                                         "layers.0.self_attn.q_norm", "layers.0.self_attn.k_norm",
                                         "layers.0.pre_feedforward_layernorm",
                                         "layers.0.post_feedforward_layernorm",
                                         "layers.0.self_attn.qkv_proj",
                                         "layers.0.mlp.gate.weight",
                                         "layers.0.mlp.experts.gate_up_proj",
                                         "layers.2.mlp.experts.down_proj",
                                         "layers.1.mlp.router", "layers.1.self_attn.sinks",
                                         "layers.1.mlp.experts", "layers.1.mlp.gate.weight",
                                         "layers.1.mlp.shared_experts",
                                         "layers.0.self_attn.o_proj.bias")):
                if p.grad is not None:
                    expected["grad." + pname] = p.grad.detach().clone()
        try:
            if getattr(model.config, "num_experts_per_tok", None) and kind != "glm4_moe":
                # A mixture of experts with output_router_logits: transformers' load-balancing loss
                # (the raw router logits of every sparse layer, softmax, top-k counts; padding
                # excluded by the mask) and the loss with it added at a coefficient large enough to
                # show in every router's gradient.
                model.zero_grad()
                model.router_aux_loss_coef = 0.25
                out = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
                out.loss.backward()
                expected["aux.coef"] = torch.tensor([0.25])
                expected["aux.aux_loss"] = out.aux_loss.detach().reshape(1)
                expected["aux.loss"] = out.loss.detach().reshape(1)
                for pname, p in model.named_parameters():
                    if ("mlp.gate.weight" in pname or "mlp.router." in pname or "mlp.experts." in pname
                            or "lm_head" in pname):
                        expected["aux.grad." + pname] = p.grad.detach().clone()
        except Exception:
            print(f"FAILED aux of {name}", flush=True)
            traceback.print_exc()
        save_file({k: v.contiguous() for k, v in expected.items()}, os.path.join(d, "expected.safetensors"))
        if name == "llama":
            save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()},
                      os.path.join(d, "model_bf16.safetensors"), metadata={"format": "pt"})
        if name == "qwen2":
            sd = os.path.join(root, "qwen2_sharded")
            model.save_pretrained(sd, safe_serialization=True, max_shard_size="100KB")
        print("model", name, "loss", float(out.loss))


PEFT_CASES = {
    "lora": dict(kind="lora", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "lora_rslora_all_linear": dict(kind="lora", r=8, lora_alpha=16, target_modules="all-linear",
                                   use_rslora=True),
    "ptuning_mlp": dict(kind="ptuning", num_virtual_tokens=4, encoder_hidden_size=32,
                        encoder_reparameterization_type="MLP"),
    "ptuning_lstm": dict(kind="ptuning", num_virtual_tokens=4, encoder_hidden_size=32,
                         encoder_reparameterization_type="LSTM"),
    "prefix": dict(kind="prefix", num_virtual_tokens=4, prefix_projection=False),
    "prefix_projection": dict(kind="prefix", num_virtual_tokens=4, prefix_projection=True,
                              encoder_hidden_size=32),
}


def make_peft():
    from peft import (LoraConfig, PrefixTuningConfig, PromptEncoderConfig, TaskType,
                      get_peft_model)
    from safetensors.torch import save_file
    root = os.path.join(OUT, "peft")
    for name, spec in PEFT_CASES.items():
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        kind, kwargs = MODELS["llama"]
        base = build(kind, kwargs, seed=sum(map(ord, "llama")))
        spec = dict(spec)
        method = spec.pop("kind")
        if method == "lora":
            cfg = LoraConfig(task_type=TaskType.CAUSAL_LM, lora_dropout=0.0, bias="none", **spec)
        elif method == "ptuning":
            cfg = PromptEncoderConfig(task_type=TaskType.CAUSAL_LM, **spec)
        else:
            cfg = PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, **spec)
        torch.manual_seed(77)
        model = get_peft_model(base, cfg)
        if method == "lora":  # B starts at zero: give the adapter an effect worth checking
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    if "lora_B" in pname:
                        p.copy_(0.05 * torch.randn_like(p))
        trainable, total = model.get_nb_trainable_parameters()
        model.save_pretrained(d)
        ids, mask, labels = inputs(kwargs["vocab_size"])
        model.eval()
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
        save_file({"input_ids": ids, "attention_mask": mask, "labels": labels,
                   "logits": out.logits.contiguous(), "loss": out.loss.reshape(1)},
                  os.path.join(d, "expected.safetensors"))
        # The full trainable state (PEFT saves only part of it for prompt methods).
        state = {k: v.detach().contiguous() for k, v in model.named_parameters() if v.requires_grad}
        save_file(state, os.path.join(d, "trainable_state.safetensors"))
        write_json(os.path.join(d, "counts.json"), {"trainable": trainable, "all": total,
                                                     "base_model": "models/llama"})
        print("peft", name, "trainable", trainable, "all", total, "loss", float(out.loss))


# DoRA and PiSSA adapters PEFT makes (peft/dora_*, peft/pissa_*): start.safetensors holds what
# PEFT started them at (DoRA's magnitudes; PiSSA's factors and residual weights), under
# zerotrain's parameter names; then B (and DoRA's magnitude) are moved off their start so the
# adapter does something, and expected.safetensors holds the eval logits and loss and, in train
# mode, every trainable parameter's gradient ("grad.<name>").
VARIANT_CASES = {
    "dora_llama": ("llama", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                 use_dora=True)),
    "dora_qwen2_all_linear": ("qwen2", dict(r=4, lora_alpha=8, target_modules="all-linear",
                                            use_dora=True, use_rslora=True)),
    "pissa_llama": ("llama", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                  init_lora_weights="pissa")),
}


def peft_model(models, family, spec):
    """PEFT's LoRA `spec` (no dropout, no bias) on `family`'s fixture weights from `models`,
    drawn from seed 77; returns (the PEFT model, the family's config kwargs)."""
    from peft import LoraConfig, TaskType, get_peft_model
    kind, kwargs = models[family]
    base = build(kind, kwargs, seed=sum(map(ord, family)))
    cfg = LoraConfig(task_type=TaskType.CAUSAL_LM, lora_dropout=0.0, bias="none", **spec)
    torch.manual_seed(77)
    return get_peft_model(base, cfg), kwargs


def eval_and_gradients(model, vocab, name_of):
    """The fixed inputs, the eval logits and loss, then one train-mode backward's gradient of
    every trainable parameter ("grad." + name_of(name)); returns (expected, eval output)."""
    ids, mask, labels = inputs(vocab)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
    expected = {"input_ids": ids, "attention_mask": mask, "labels": labels,
                "logits": out.logits.contiguous(), "loss": out.loss.reshape(1)}
    model.train()
    model.zero_grad()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    for pname, p in model.named_parameters():
        if p.requires_grad:
            expected["grad." + name_of(pname)] = p.grad.detach().contiguous()
    return expected, out


def our_name(peft_name):
    """base_model.model.X.lora_A.default.weight -> X.lora_A.weight (zerotrain's names)."""
    n = peft_name.replace("base_model.model.", "", 1).replace(".default", "")
    n = n.replace(".base_layer.", ".")
    if n.endswith(".lora_magnitude_vector.weight"):  # PEFT's DoraLinearLayer.weight
        n = n[:-len(".weight")]
    return n


def make_variants():
    from safetensors.torch import save_file
    root = os.path.join(OUT, "peft")
    for name, (family, spec) in VARIANT_CASES.items():
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        model, kwargs = peft_model(MODELS, family, spec)
        start = {}
        for pname, p in model.named_parameters():
            if "lora_magnitude_vector" in pname or (spec.get("init_lora_weights") == "pissa" and (
                    "lora_A" in pname or "lora_B" in pname or
                    (pname.endswith("base_layer.weight")))):
                start[our_name(pname)] = p.detach().clone().contiguous()
        save_file(start, os.path.join(d, "start.safetensors"))
        if spec.get("init_lora_weights") == "pissa":
            # PEFT's conversion needs the adapter as it started, saved with init_lora_weights True.
            model.peft_config["default"].init_lora_weights = True
            model.save_pretrained(os.path.join(d, "pissa_init"))
            model.peft_config["default"].init_lora_weights = "pissa"
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.add_(0.05 * torch.randn_like(p))
                elif "lora_magnitude_vector" in pname:
                    p.mul_(1.0 + 0.1 * torch.randn_like(p))
        model.save_pretrained(d)
        if spec.get("init_lora_weights") == "pissa":
            model.save_pretrained(os.path.join(d, "pissa_converted"),
                                  path_initial_model_for_weight_conversion=os.path.join(d, "pissa_init"))
        expected, out = eval_and_gradients(model, kwargs["vocab_size"], our_name)
        save_file(expected, os.path.join(d, "expected.safetensors"))
        trainable, total = model.get_nb_trainable_parameters()
        write_json(os.path.join(d, "counts.json"), {"trainable": trainable, "all": total,
                                                     "base_model": "models/" + family})
        print("variant", name, "trainable", trainable, "all", total, "loss", float(out.loss))


# LoRA on the experts (peft/experts_*): PEFT 0.21's target_parameters on transformers 5's fused
# expert tensors (one ParamWrapper per tensor: lora_A [r * E, in], lora_B [out, r * E]) beside
# target_modules on the attention, made on the MoE family fixtures' own weights; expected holds
# the eval logits and loss and one train-mode backward's gradients of every LoRA tensor, and
# keys.json the state-dict names PEFT saved.
EXPERT_CASES = {
    "experts_qwen3_moe": ("qwen3_moe", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            target_parameters=["experts.gate_up_proj",
                                                               "experts.down_proj"])),
    "experts_mixtral_rslora": ("mixtral", dict(r=2, lora_alpha=4, target_modules=["o_proj"],
                                               target_parameters=["experts.down_proj"],
                                               use_rslora=True)),
    # gpt-oss keeps its experts transposed ([E, in, out]) and biased; GLM-4.5's routed experts
    # sit beside a shared expert (nn.Linear modules, targeted by name).
    "experts_gpt_oss": ("gpt_oss", dict(r=4, lora_alpha=8, target_modules=["q_proj"],
                                        target_parameters=["experts.gate_up_proj",
                                                           "experts.down_proj"])),
    "experts_glm4_moe": ("glm4_moe", dict(r=2, lora_alpha=8, target_modules=["k_proj", "down_proj"],
                                          target_parameters=["experts.gate_up_proj"])),
    # PEFT's conversion for transformers 5: all-linear (attention, routers, the experts with
    # gate_up_proj at rank 2r) and Mixtral's 4.x names.
    "experts_qwen3_moe_all_linear": ("qwen3_moe", dict(r=2, lora_alpha=4, target_modules="all-linear")),
    "experts_mixtral_w123": ("mixtral", dict(r=2, lora_alpha=8,
                                             target_modules=["q_proj", "w1", "w2", "w3", "gate"])),
}


def make_experts():
    from safetensors.torch import save_file
    root = os.path.join(OUT, "peft")
    for name, (family, spec) in EXPERT_CASES.items():
        try:
            d = os.path.join(root, name)
            os.makedirs(d, exist_ok=True)
            model, kwargs = peft_model(FAMILY_MODELS, family, spec)
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    if "lora_B" in pname:
                        p.copy_(0.05 * torch.randn_like(p))
            model.save_pretrained(d)
            expected, out = eval_and_gradients(model, kwargs["vocab_size"], lambda n: n)
            names = {n: list(p.shape) for n, p in model.named_parameters() if p.requires_grad}
            save_file(expected, os.path.join(d, "expected.safetensors"))
            trainable, total = model.get_nb_trainable_parameters()
            from safetensors import safe_open
            with safe_open(os.path.join(d, "adapter_model.safetensors"), "pt") as f:
                saved = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
            write_json(os.path.join(d, "counts.json"), {"trainable": trainable, "all": total,
                                                         "base_model": "models/" + family})
            write_json(os.path.join(d, "keys.json"), {"parameters": names, "saved": saved})
            print("experts", name, "trainable", trainable, "loss", float(out.loss), "saved", saved,
                  flush=True)
        except Exception:
            print(f"FAILED experts case {name}", flush=True)
            traceback.print_exc()


QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
LLAMA3_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\r\n\r\nand blank lines\n\n\n",
    "I'm sure you'll see they've done it, we'd say it's THE END'S",
    "Numbers: 1 12 123 1234 12345 3.14159 -42 1,000,000 2026-11-29",
    "深度学习模型的微调需要大量的计算资源。",
    "混合 English 和中文 text 123 测试",
    "日本語のテキストも少し。한국어도 조금.",
    "Emoji 🙂🚀🔥 and flags 🇫🇷 and ZWJ 👩‍💻",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}",
    "Ünïcödé àccents café naïve façade",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "word" * 20,
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "!!! ??? ... --- *** ###",
    "",
    " ",
    "\n",
    "Mixed\u200bzero\u200bwidth",
    "Ⅻ ½ ² ٣ numbers in other scripts ١٢٣",
    "<|im_start|>user\nWhat is ZeRO?<|im_end|>\n<|im_start|>assistant\nSharding.<|im_end|>",
    "Text with <|endoftext|> inside and <s> tags </s> around <unk>",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "x" + " " * 7 + "y",
    "ZWJ family 👨‍👩‍👧‍👦 and skin tone 👍🏽",
]

CORPUS_EN = ("The model learns from data. Training large language models requires careful "
             "engineering of memory, communication and numerics. Optimizer states are sharded "
             "across ranks; gradients are reduced in buckets while the backward pass runs. ")
CORPUS_ZH = "大规模语言模型的训练需要仔细设计内存、通信和数值精度。优化器状态在多个进程之间分片。"
CORPUS_CODE = "def train(model, data):\n    for batch in data:\n        loss = model(batch)\n        loss.backward()\n"


def corpus():
    lines = []
    for i in range(400):
        lines.append(CORPUS_EN[(i * 7) % 50:] + f" step {i} loss {1.0 / (i + 1):.4f}")
        lines.append(CORPUS_ZH[(i * 3) % 20:])
        lines.append(CORPUS_CODE.replace("batch", f"batch{i % 10}"))
    return lines + TEXTS


def record_cases(tok_dir, tok, hf_extra=True):
    cases = []
    fast = None
    if hf_extra:
        from transformers import AutoTokenizer
        fast = AutoTokenizer.from_pretrained(tok_dir)
    for text in TEXTS:
        enc = tok.encode(text, add_special_tokens=False)
        with_special = tok.encode(text, add_special_tokens=True)
        case = {"text": text, "ids": enc.ids, "ids_with_special_tokens": with_special.ids,
                "decoded": tok.decode(enc.ids, skip_special_tokens=False),
                "decoded_skip_special": tok.decode(enc.ids, skip_special_tokens=True)}
        if fast is not None:
            case["transformers_ids"] = fast(text)["input_ids"]
        cases.append(case)
    write_json(os.path.join(tok_dir, "cases.json"), cases)


def make_tokenizers():
    from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                            processors, trainers)
    root = os.path.join(OUT, "tokenizers")
    lines = corpus()

    # Byte-level BPE (Qwen2, LLaMA-3).
    for name, pattern, specials, cfg in [
        ("qwen2", QWEN2_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
         {"add_bos_token": False, "add_eos_token": False, "bos_token": None,
          "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": 32768,
          "tokenizer_class": "Qwen2Tokenizer", "clean_up_tokenization_spaces": False}),
        ("llama3", LLAMA3_SPLIT, ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"],
         {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
          "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast",
          "clean_up_tokenization_spaces": True}),
    ]:
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(lines, trainer=trainer)
        if name == "llama3":  # LLaMA-3 prepends <|begin_of_text|>
            bos = specials[0]
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, tok.token_to_id(bos))])
        else:
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
        tok.save(os.path.join(d, "tokenizer.json"))
        write_json(os.path.join(d, "tokenizer_config.json"), cfg)
        record_cases(d, Tokenizer.from_file(os.path.join(d, "tokenizer.json")))
        print("tokenizer", name, tok.get_vocab_size())

    # SentencePiece-style BPE with byte fallback (LLaMA-2: normalizer; Mistral: Metaspace).
    for name in ("llama2", "mistral"):
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
        trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<unk>", "<s>", "</s>"],
                                      show_progress=False)
        trainer_tok.train_from_iterator(lines, trainer=trainer)
        learned = json.loads(trainer_tok.to_str())["model"]
        # Vocabulary laid out as LLaMA's: specials, the 256 byte tokens, then learned pieces.
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
        for b in range(256):
            vocab[f"<0x{b:02X}>"] = len(vocab)
        for piece, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
            if piece not in vocab:
                vocab[piece] = len(vocab)
        merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True,
                                   byte_fallback=True))
        if name == "llama2":
            tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                                   normalizers.Replace(" ", "▁")])
        else:
            tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                         split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
        from tokenizers import AddedToken
        tok.add_special_tokens([AddedToken("<unk>", normalized=False, special=True),
                                AddedToken("<s>", normalized=False, special=True),
                                AddedToken("</s>", normalized=False, special=True)])
        tok.save(os.path.join(d, "tokenizer.json"))
        write_json(os.path.join(d, "tokenizer_config.json"),
                   {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>",
                    "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
                    "legacy": False, "model_max_length": 4096,
                    "tokenizer_class": "LlamaTokenizerFast" if name == "llama2" else "PreTrainedTokenizerFast",
                    "clean_up_tokenization_spaces": False})
        record_cases(d, Tokenizer.from_file(os.path.join(d, "tokenizer.json")))
        print("tokenizer", name, tok.get_vocab_size())


# SentencePiece normalization rules (code points in hex, source TAB target) for the Unigram
# fixture's own precompiled charsmap: full-width letters and digits, a ligature, compositions
# of two code points (which the Precompiled normalizer matches per grapheme), spaces.
SPM_RULES = ([(f"{0xFF21 + i:X}", f"{0x41 + i:X}") for i in range(26)] +
             [(f"{0xFF41 + i:X}", f"{0x61 + i:X}") for i in range(26)] +
             [(f"{0xFF10 + i:X}", f"{0x30 + i:X}") for i in range(10)] +
             [("FB01", "66 69"), ("65 301", "E9"), ("61 300", "E0"), ("6F 308", "F6"),
              ("3000", "20"), ("A0", "20"), ("2028", "20"), ("2160", "49"), ("2161", "49 49"),
              ("2026", "2E 2E 2E"), ("9", "20")])


def make_tokenizer_models():
    """The models and components beyond BPE, each in a small tokenizer trained here, with the
    ids HF tokenizers gives for TEXTS: unigram_spm (a SentencePiece Unigram model with its own
    precompiled charsmap and byte fallback, converted as transformers converts T5 / ALBERT),
    unigram_albert (Unigram, ALBERT's normalizers: Replace by string and regex, NFKD,
    StripAccents, Lowercase), wordpiece (BERT's pipeline), wordlevel (NFD / Lowercase /
    StripAccents / Nmt, Whitespace, BertProcessing) and bpe_suffix (BPE with a subword prefix
    and an end-of-word suffix, Strip, CharDelimiterSplit, Punctuation, Digits, RobertaProcessing,
    the BPE decoder)."""
    import tempfile

    import sentencepiece as spm
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                            pre_tokenizers, processors, trainers)
    root = os.path.join(OUT, "tokenizers")
    lines = corpus()
    fast = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
            "model_max_length": 512}

    def save(name, tok, cfg):
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        tok.save(os.path.join(d, "tokenizer.json"))
        write_json(os.path.join(d, "tokenizer_config.json"), dict(fast, **cfg))
        record_cases(d, Tokenizer.from_file(os.path.join(d, "tokenizer.json")))
        print("tokenizer", name, tok.get_vocab_size(), flush=True)

    # unigram_spm: trained by SentencePiece itself.
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "corpus.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(l.replace("\n", " ") for l in lines if l.strip()))
        with open(os.path.join(tmp, "rules.tsv"), "w") as f:
            f.write("".join(f"{a}\t{b}\n" for a, b in SPM_RULES))
        spm.SentencePieceTrainer.train(
            input=os.path.join(tmp, "corpus.txt"), model_prefix=os.path.join(tmp, "m"),
            vocab_size=700, model_type="unigram", byte_fallback=True,
            normalization_rule_tsv=os.path.join(tmp, "rules.tsv"), character_coverage=0.9995,
            pad_id=0, unk_id=1, bos_id=2, eos_id=3, minloglevel=2, hard_vocab_limit=False)
        from sentencepiece import sentencepiece_model_pb2 as pb
        proto = pb.ModelProto()
        with open(os.path.join(tmp, "m.model"), "rb") as f:
            proto.ParseFromString(f.read())
    vocab = [(p.piece, p.score) for p in proto.pieces]
    tok = Tokenizer(models.Unigram(vocab, unk_id=1, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([
        normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap),
        normalizers.Strip(left=False, right=True), normalizers.Replace(Regex(" {2,}"), "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="always"),
                                     decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 3)])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t in ("<pad>", "<unk>", "<s>", "</s>")])
    save("unigram_spm", tok, {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"})

    # unigram_albert: trained by HF's Unigram trainer, ALBERT's normalizers.
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([
        normalizers.Replace("``", '"'), normalizers.Replace("''", '"'), normalizers.NFKD(),
        normalizers.StripAccents(), normalizers.Lowercase(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=600, unk_token="<unk>", show_progress=False,
                                      special_tokens=["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"])
    tok.train_from_iterator(lines, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    save("unigram_albert", tok, {"bos_token": "[CLS]", "eos_token": "[SEP]", "unk_token": "<unk>",
                                 "pad_token": "<pad>"})

    # wordpiece: BERT's pipeline.
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=30))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                strip_accents=None, lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    trainer = trainers.WordPieceTrainer(vocab_size=700, show_progress=False,
                                        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok.train_from_iterator(lines, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    save("wordpiece", tok, {"bos_token": "[CLS]", "eos_token": "[SEP]", "unk_token": "[UNK]",
                            "pad_token": "[PAD]"})

    # wordlevel: a word vocabulary with BERT's processor.
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.normalizer = normalizers.Sequence([normalizers.Nmt(), normalizers.NFD(),
                                           normalizers.Lowercase(), normalizers.StripAccents()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=500, show_progress=False,
                                        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    tok.train_from_iterator(lines, trainer=trainer)
    tok.post_processor = processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")),
                                                   ("[CLS]", tok.token_to_id("[CLS]")))
    save("wordlevel", tok, {"bos_token": "[CLS]", "eos_token": "[SEP]", "unk_token": "[UNK]",
                            "pad_token": "[PAD]"})

    # bpe_suffix: BPE with a continuing-subword prefix and an end-of-word suffix.
    tok = Tokenizer(models.BPE(unk_token="<unk>", continuing_subword_prefix="##",
                               end_of_word_suffix="</w>"))
    tok.normalizer = normalizers.Sequence([normalizers.Strip(left=True, right=True),
                                           normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.CharDelimiterSplit(" "),
                                                 pre_tokenizers.Punctuation(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.decoder = decoders.BPEDecoder(suffix="</w>")
    trainer = trainers.BpeTrainer(vocab_size=800, show_progress=False,
                                  special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                                  continuing_subword_prefix="##", end_of_word_suffix="</w>")
    tok.train_from_iterator(lines, trainer=trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), trim_offsets=False,
                                                      add_prefix_space=False)
    save("bpe_suffix", tok, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                             "pad_token": "<pad>"})


def versions():
    import importlib
    v = {}
    for mod in ("torch", "transformers", "peft", "tokenizers", "safetensors"):
        try:
            v[mod] = importlib.import_module(mod).__version__
        except Exception as e:  # noqa: BLE001
            v[mod] = f"unavailable: {e}"
    os.makedirs(OUT, exist_ok=True)
    write_json(os.path.join(OUT, "VERSIONS.json"), v)


def make_families():
    """FAMILY_MODELS, each on its own: one that fails leaves the others made."""
    only = set(filter(None, os.environ.get("FAMILIES", "").split(",")))
    for name, spec in FAMILY_MODELS.items():
        if only and name not in only:
            continue
        try:
            make_models({name: spec})
            with open(os.path.join(OUT, "models", name, "config.json")) as f:
                print(name, "config.json:", f.read(), flush=True)
        except Exception:
            print(f"FAILED family model {name}", flush=True)
            traceback.print_exc()


def make_mxfp4():
    """models/gpt_oss_mxfp4: the gpt_oss fixture as released models are stored — its experts as
    random MXFP4 `_blocks` / `_scales` with quantization_config {"quant_method": "mxfp4"} — and
    the logits transformers gives after loading it with Mxfp4Config(dequantize=True), plus the
    experts it dequantized (the reference of zerotrain's reader)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Mxfp4Config
    src = os.path.join(OUT, "models", "gpt_oss")
    if not os.path.isdir(src):
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "models",
                           "gpt_oss")
    d = os.path.join(OUT, "models", "gpt_oss_mxfp4")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}
    write_json(os.path.join(d, "config.json"), config)
    gen = torch.Generator().manual_seed(11)
    tensors = {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        if name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
            e, cols, rows = t.shape  # [E, in, out]
            tensors[name + "_blocks"] = torch.randint(0, 256, (e, rows, cols // 32, 16),
                                                      generator=gen, dtype=torch.uint8)
            tensors[name + "_scales"] = torch.randint(118, 130, (e, rows, cols // 32),
                                                      generator=gen, dtype=torch.uint8)
        else:
            tensors[name] = t.contiguous()
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(
        d, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32)
    model = model.to("cpu").float().eval()
    ids, mask, _ = inputs(config["vocab_size"])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    expected = {"input_ids": ids, "attention_mask": mask, "logits": logits}
    for name, p in model.named_parameters():
        if name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
            expected[name] = p.detach().float().contiguous()
    save_file(expected, os.path.join(d, "expected.safetensors"))
    print("mxfp4", {k: list(v.shape) for k, v in expected.items()}, flush=True)


def make_mistral3():
    """models/mistral3: a Mistral3ForConditionalGeneration (Mistral-Small-3.1 / 3.2 as published)
    with a tiny Pixtral tower, saved as save_pretrained writes it, and expected.safetensors for
    text alone (logits, hidden states, loss, gradients), the decoder being Mistral's with its
    head_dim and untied head."""
    from safetensors.torch import save_file
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration
    text = dict(TINY, model_type="mistral", head_dim=32, rope_theta=1000000000.0,
                sliding_window=None, tie_word_embeddings=False)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, head_dim=16, image_size=28, patch_size=14)
    cfg = Mistral3Config(text_config=text, vision_config=vision, image_token_index=10,
                         spatial_merge_size=2)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(sum(map(ord, "mistral3")))
    model = Mistral3ForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "vision_tower" in name or "multi_modal_projector" in name:
                p.normal_(0.0, 0.02)
    d = os.path.join(OUT, "models", "mistral3")
    os.makedirs(d, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    ids, mask, labels = inputs(text["vocab_size"])
    ids[ids == 10] = 11  # no image token in text alone
    labels = torch.where(labels == 10, torch.full_like(labels, 11), labels)
    model.train()
    out = model(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True)
    out.loss.backward()
    expected = {"input_ids": ids, "attention_mask": mask, "labels": labels,
                "logits": out.logits.detach(), "loss": out.loss.detach().reshape(1)}
    for i, h in enumerate(out.hidden_states):
        expected[f"hidden_states.{i}"] = h.detach()
    for pname, p in model.named_parameters():
        if p.grad is not None and ("language_model" in pname or pname.startswith("lm_head")) and any(
                k in pname for k in ("embed_tokens", "layers.0.self_attn.q_proj",
                                     "layers.1.mlp.down_proj", "language_model.norm", "lm_head")):
            expected["grad." + pname] = p.grad.detach().clone()
    save_file({k: v.contiguous() for k, v in expected.items()},
              os.path.join(d, "expected.safetensors"))
    from safetensors import safe_open
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        keys = sorted(f.keys())
        print("mistral3", keys[:3], [k for k in keys if "lm_head" in k], len(keys), flush=True)
    print("mistral3 loss", float(out.loss.detach()), sorted(expected)[:8], flush=True)


def make_multimodal():
    """models/gemma3: a Gemma3ForConditionalGeneration (model_type gemma3, the only form Gemma 3
    4B / 12B / 27B are published in) with a tiny SigLIP tower, saved as save_pretrained writes it
    (text_config written as a diff against Gemma3TextConfig's defaults), and expected.safetensors
    for text alone: logits, hidden states, loss and gradients in train mode (token_type_ids all
    zero, as transformers 5 requires there), the decoder being Gemma 3's. models/gemma3_new_names:
    the same weights under transformers' module names (model.language_model.*), as 4.52-4.57
    saved them."""
    from safetensors.torch import save_file
    import transformers
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    _, text = FAMILY_MODELS["gemma3_text"]
    text = dict(text, model_type="gemma3_text")
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14,
                  vision_use_head=False)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(sum(map(ord, "gemma3")))
    model = Gemma3ForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "vision_tower" in name or "multi_modal_projector" in name:
                p.normal_(0.0, 0.02)
    d = os.path.join(OUT, "models", "gemma3")
    os.makedirs(d, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    d2 = os.path.join(OUT, "models", "gemma3_new_names")
    os.makedirs(d2, exist_ok=True)
    try:
        model.save_pretrained(d2, safe_serialization=True, save_original_format=False)
    except TypeError:  # 4.x: its own names are the new ones
        model.save_pretrained(d2, safe_serialization=True)
    ids, mask, labels = inputs(text["vocab_size"])
    model.train()
    out = model(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True,
                token_type_ids=torch.zeros_like(ids))
    out.loss.backward()
    expected = {"input_ids": ids, "attention_mask": mask, "labels": labels,
                "logits": out.logits.detach(), "loss": out.loss.detach().reshape(1)}
    for i, h in enumerate(out.hidden_states):
        expected[f"hidden_states.{i}"] = h.detach()
    for pname, p in model.named_parameters():
        if p.grad is not None and "language_model" in pname and any(
                k in pname for k in ("embed_tokens", "layers.0.self_attn.q_proj",
                                     "layers.1.mlp.down_proj", "layers.5.self_attn.k_norm",
                                     "language_model.norm")):
            expected["grad." + pname] = p.grad.detach().clone()
    save_file({k: v.contiguous() for k, v in expected.items()},
              os.path.join(d, "expected.safetensors"))
    from safetensors import safe_open
    for folder in (d, d2):
        with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
            print("multimodal", folder, sorted(f.keys())[:4], "...", len(list(f.keys())), flush=True)
    with open(os.path.join(d, "config.json")) as f:
        print("multimodal config.json:", f.read(), flush=True)
    print("multimodal loss", float(out.loss), transformers.__version__, flush=True)


versions()
for section, fn in (("models", make_models), ("families", make_families), ("peft", make_peft),
                    ("variants", make_variants), ("experts", make_experts), ("mxfp4", make_mxfp4),
                    ("multimodal", make_multimodal), ("mistral3", make_mistral3),
                    ("tokenizers", make_tokenizers),
                    ("tokenizer_models", make_tokenizer_models)):
    if section not in WHAT:
        continue
    try:
        fn()
    except Exception:
        print(f"FAILED section {section}", flush=True)
        traceback.print_exc()
