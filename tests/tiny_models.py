"""Tiny random models built from configs (no model hub): two dense families and the MoE families kbit supports."""

from __future__ import annotations

import os

import torch
import transformers

VOCAB = 320
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=128, tie_word_embeddings=False)

# name -> (config class, extra config fields). Sizes are deliberately not all multiples of 32 (hidden 64 is,
# the intermediate sizes are not) so that padded blocks are exercised end to end.
FAMILIES = {
    "llama": ("LlamaConfig", dict(intermediate_size=100)),
    "qwen2": ("Qwen2Config", dict(intermediate_size=100)),  # dense, with biases on q / k / v
    "mixtral": ("MixtralConfig", dict(intermediate_size=72, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=96, moe_intermediate_size=40, shared_expert_intermediate_size=48,
                                         num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=40, num_experts=4,
                                         num_experts_per_tok=2, head_dim=16)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=40, num_experts=4, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=40,
                                             n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                             n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None,
                                             kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                                             v_head_dim=16)),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=40, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                     sliding_window=32, layer_types=["sliding_attention", "full_attention"])),
}
MOE_FAMILIES = [f for f in FAMILIES if f not in ("llama", "qwen2")]


def tiny_config(family: str, **overrides):
    cls_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**{**_COMMON, **extra, **overrides})
    return cfg


def tiny_model(family: str, dtype=torch.bfloat16, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=dtype)
    with torch.no_grad():  # some families initialise expert weights to zero or leave them empty: make them random
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
            elif "bias" in name:
                p.normal_(0, 0.01)
    return model.eval()


def rewritten_copy(folder, tmp_path, name, edit):
    """A copy of a saved kbit folder with its state dict changed by edit(state)."""
    from safetensors.torch import load_file, save_file

    sd = load_file(os.path.join(folder, "model.safetensors"))
    edit(sd)
    d = tmp_path / name
    d.mkdir()
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    (d / "config.json").write_text(open(os.path.join(folder, "config.json")).read())
    return d


def byte_tokenizer():
    """A byte-level tokenizer with 256 ids (no merges), small enough for the tiny models' 320-entry vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def kbit_experts(family: str, hidden: int, inter: int, experts: int, std: float, device="cpu", dtype=torch.float32):
    """A K = 4 KbitMoE quantized from a real transformers experts class with N(0, std) weights: "qwen3" (SiLU
    gating, gate and up halves) or "gpt-oss" (clamped SwiGLU, interleaved, biases, weights stored transposed)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from kbit_hf import format as fmt
    from kbit_hf.modules import KbitMoE

    torch.manual_seed(0)
    if family == "qwen3":
        orig = Qwen3MoeExperts(transformers.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter,
                                                           num_experts=experts))
    else:
        orig = GptOssExperts(transformers.GptOssConfig(hidden_size=hidden, intermediate_size=inter,
                                                       num_local_experts=experts))
    with torch.no_grad():
        for p in orig.parameters():
            p.normal_(0.0, std)
    orig = orig.to(device, dtype)
    moe = KbitMoE(orig, 4, "e4m4", fmt.nf_codebook(4), pre_quantized=False)
    for name in moe.quantized_names:
        for n, t in moe.quantize_param(name, getattr(orig, name).data).items():
            setattr(moe, n, torch.nn.Parameter(t, requires_grad=False))
    return moe
