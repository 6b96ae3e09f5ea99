"""A plain Llama stack as a Hugging Face folder: `LlamaForCausalLM` weights and config, and the run's tokenizer.

Weights. benchctl (like llama2.c) rotates each pair of adjacent query/key features (2i, 2i+1) of a head; transformers'
Llama rotates feature i with feature i + head_dim/2 ("rotate half"). The same attention is obtained by reordering the
rows of wq and wk within each head: the even rows first, then the odd ones (llama2.c's export.py applies the same
permutation). Scores q.k are unchanged by a permutation applied to both, and values and wo are untouched. The SwiGLU
projections map w1 -> gate_proj, w3 -> up_proj, w2 -> down_proj; the embedding and the head stay one tied tensor.

Tokenizer. The run's SentencePiece model becomes a `tokenizer.json` (transformers converts the pieces and merges) that
encodes exactly as SentencePiece does: SentencePiece by default removes spaces at both ends of the text and squeezes
runs of spaces into one before prepending its word-boundary mark, which the converted Llama tokenizer does not, so the
export adds those two rules as a normalizer. BOS (<s>, id 1) starts every encoded text, as it started every training
sequence; a story ends where the model emits BOS again, so generation stops at BOS (`generation_config.json`).
`tokenizer.model` is copied beside it for tools that read SentencePiece directly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from benchctl.export.llama import LlamaWeights

BOS_ID = 1  # benchctl's (llama2.c's) tokenizer: unk 0, bos 1, eos 2


def rotate_half_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a query/key projection (n_heads * head_dim, in) from interleaved-pair to rotate-half order, per head."""
    out, inp = w.shape
    hd = out // n_heads
    return w.view(n_heads, hd // 2, 2, inp).transpose(1, 2).reshape(out, inp).contiguous()


def hf_state_dict(weights: LlamaWeights) -> dict[str, torch.Tensor]:
    s = weights.shape
    sd = {"model.embed_tokens.weight": weights.embedding.contiguous(), "model.norm.weight": weights.norm.contiguous()}
    for i, la in enumerate(weights.layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = rotate_half_rows(la["wq"], s.n_heads)
        sd[p + "self_attn.k_proj.weight"] = rotate_half_rows(la["wk"], s.n_kv_heads)
        sd[p + "self_attn.v_proj.weight"] = la["wv"].contiguous()
        sd[p + "self_attn.o_proj.weight"] = la["wo"].contiguous()
        sd[p + "mlp.gate_proj.weight"] = la["w1"].contiguous()
        sd[p + "mlp.up_proj.weight"] = la["w3"].contiguous()
        sd[p + "mlp.down_proj.weight"] = la["w2"].contiguous()
        sd[p + "input_layernorm.weight"] = la["attention_norm"].contiguous()
        sd[p + "post_attention_layernorm.weight"] = la["ffn_norm"].contiguous()
    return sd


def hf_config(weights: LlamaWeights) -> dict[str, Any]:
    """config.json of the equivalent LlamaForCausalLM (plain JSON: transformers fills in the rest of its defaults)."""
    import transformers

    s = weights.shape
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": s.vocab_size,
        "hidden_size": s.dim,
        "intermediate_size": s.hidden_dim,
        "num_hidden_layers": s.n_layers,
        "num_attention_heads": s.n_heads,
        "num_key_value_heads": s.n_kv_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_seq_len,
        "rms_norm_eps": s.norm_eps,
        # both spellings: transformers 5 reads rope_parameters, earlier versions rope_theta
        "rope_parameters": {"rope_type": "default", "rope_theta": s.rope_theta},
        "rope_theta": s.rope_theta,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "eos_token_id": BOS_ID,
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
        "transformers_version": transformers.__version__,
    }


def write_tokenizer(sp_model: Path, out: Path, max_len: int) -> None:
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json and tokenizer.model in `out`."""
    from tokenizers import Regex, normalizers, pre_tokenizers, processors
    from transformers import LlamaTokenizerFast

    shutil.copyfile(sp_model, out / "tokenizer.model")
    # transformers converts tokenizer.model's pieces and merges into a tokenizers BPE
    converted = LlamaTokenizerFast.from_pretrained(str(out), legacy=False)
    bt = converted.backend_tokenizer
    bt.normalizer = normalizers.Sequence(
        [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    )
    # "always", not "first": with split=False the text is one piece, and "first" skips the mark when the normalizer
    # has removed leading spaces (the piece then no longer starts at offset 0)
    bt.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=False)
    bt.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    bt.save(str(out / "tokenizer.json"))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                **specials,
                "add_bos_token": True,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": max_len,
            },
            indent=2,
        )
        + "\n"
    )
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def write_hf_model(weights: LlamaWeights, out: Path) -> None:
    """config.json, generation_config.json and model.safetensors: what `from_pretrained` needs to build the model
    (`benchctl bench --decode` loads them without a tokenizer)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(weights), indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": BOS_ID}, indent=2) + "\n"
    )
    save_file(hf_state_dict(weights), str(out / "model.safetensors"), metadata={"format": "pt"})


def write_hf(weights: LlamaWeights, sp_model: Path, out: Path) -> list[str]:
    """The folder's model files (config, generation config, safetensors, tokenizer); returns the names written."""
    write_hf_model(weights, out)
    write_tokenizer(sp_model, out, weights.shape.max_seq_len)
    return sorted(p.name for p in out.iterdir())
