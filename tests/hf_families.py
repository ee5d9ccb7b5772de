"""Tiny configs of the transformers families hetrain is checked on, each built from its config.json on CPU.

Each is the family's own ``model_type`` with sizes small enough to trace and run in a second, and with the
options that make its forward do more than its named parts switched on (Gemma2's soft-caps, Granite's
multipliers, Cohere's logit scale, the MoE router's auxiliary loss).
"""

from __future__ import annotations

from typing import Any

VOCAB = 128
_BASE: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
                         "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}

FAMILIES: dict[str, dict[str, Any]] = {
    "gpt2": {"model_type": "gpt2", "vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
             "bos_token_id": 0, "eos_token_id": 0},
    "llama": {"model_type": "llama", **_BASE},
    "llama-tied": {"model_type": "llama", **_BASE, "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", **_BASE, "sliding_window": 4},
    "qwen2": {"model_type": "qwen2", **_BASE, "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", **_BASE, "head_dim": 8},
    "gemma": {"model_type": "gemma", **_BASE, "head_dim": 8},
    "gemma2": {"model_type": "gemma2", **_BASE, "head_dim": 8, "final_logit_softcapping": 3.0,
               "attn_logit_softcapping": 5.0, "sliding_window": 4},
    "phi": {"model_type": "phi", **_BASE},
    "phi3": {"model_type": "phi3", **_BASE},
    "gpt_neox": {"model_type": "gpt_neox", **_BASE},
    "opt": {"model_type": "opt", "vocab_size": VOCAB, "hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 64, "word_embed_proj_dim": 32, "bos_token_id": 0,
            "eos_token_id": 0, "pad_token_id": 1},
    "falcon": {"model_type": "falcon", "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 4, "max_position_embeddings": 64, "bos_token_id": 0, "eos_token_id": 0},
    "cohere": {"model_type": "cohere", **_BASE, "logit_scale": 0.5},
    "granite": {"model_type": "granite", **_BASE, "embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                "logits_scaling": 4.0, "attention_multiplier": 0.3},
    "olmo": {"model_type": "olmo", **_BASE},
    "olmo2": {"model_type": "olmo2", **_BASE},
    "starcoder2": {"model_type": "starcoder2", **_BASE},
    "mixtral": {"model_type": "mixtral", **_BASE, "num_local_experts": 4, "num_experts_per_tok": 2,
                "output_router_logits": True, "router_aux_loss_coef": 0.02},
    "qwen2_moe": {"model_type": "qwen2_moe", **_BASE, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "output_router_logits": True},
}

#: the families whose forward does more than their named parts, or whose loss has a second term: trained from
#: the CLI in the default suite (the rest with HETRAIN_ALL_FAMILIES=1)
CLI_FAMILIES = ("gemma2", "granite", "mixtral")

#: encoders trained as masked LMs: their own loss at the masked positions, their labels not shifted
ENCODERS: dict[str, dict[str, Any]] = {
    "bert": {"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": VOCAB, "hidden_size": 32,
             "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
             "max_position_embeddings": 64, "pad_token_id": 0},
    "roberta": {"model_type": "roberta", "architectures": ["RobertaForMaskedLM"], "vocab_size": VOCAB,
                "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
                "max_position_embeddings": 72, "pad_token_id": 1},
    "distilbert": {"model_type": "distilbert", "architectures": ["DistilBertForMaskedLM"], "vocab_size": VOCAB,
                   "dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64, "max_position_embeddings": 64,
                   "pad_token_id": 0},
}
