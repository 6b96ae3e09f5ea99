"""A plain Llama stack as llama2.c files: `model.bin` (the version-0 "legacy" layout run.c reads) and `tokenizer.bin`.

model.bin: a header of seven int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, max_seq_len), then
float32 tensors, row-major, each kind for every layer before the next kind: token embedding (vocab, dim); attention
RMSNorm gains (layers, dim); wq, wk, wv, wo; FFN RMSNorm gains; w1, w2, w3; the final norm (dim); the RoPE cos and sin
tables (max_seq_len, head_dim/2 each, which run.c skips); and the classifier only when it is not the embedding, which
the header signals with a negative vocab_size. benchctl's weights are already in llama2.c's layout (interleaved RoPE
pairs, w1/w2/w3), so nothing is permuted. run.c hard-codes RMSNorm's eps (1e-5) and RoPE's theta (10000), so a model
trained with others is refused rather than written into a file that run.c would read wrongly.

tokenizer.bin: as llama2.c's tokenizer.py writes it: the longest token's byte length (uint32), then per token id its
score (float32), its byte length (uint32) and its bytes, where BOS and EOS are written as "\\n<s>\\n" and
"\\n</s>\\n", a byte piece "<0xAB>" as the character chr(0xAB) (in UTF-8), and "▁" as a space.
"""

from __future__ import annotations

import struct
from pathlib import Path

import torch

from architectures.blocks import precompute_rope
from benchctl.core.errors import ConfigError
from benchctl.export.llama import LlamaWeights

RUN_C_NORM_EPS = 1e-5
RUN_C_ROPE_THETA = 10000.0
ORDER = ("attention_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3")


def check_run_c(weights: LlamaWeights) -> None:
    s = weights.shape
    if s.norm_eps != RUN_C_NORM_EPS or s.rope_theta != RUN_C_ROPE_THETA:
        raise ConfigError(
            f"--format llama2c: run.c hard-codes RMSNorm eps {RUN_C_NORM_EPS:g} and RoPE theta "
            f"{RUN_C_ROPE_THETA:g}, this model has eps {s.norm_eps:g} and theta {s.rope_theta:g}; use --format hf"
        )


def _f32(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().float().numpy().astype("<f4", copy=False).tobytes()


def write_model_bin(weights: LlamaWeights, path: Path) -> None:
    check_run_c(weights)
    s = weights.shape
    shared = True  # benchctl ties the head to the embedding, always
    vocab = s.vocab_size if shared else -s.vocab_size
    header = struct.pack("<7i", s.dim, s.hidden_dim, s.n_layers, s.n_heads, s.n_kv_heads, vocab, s.max_seq_len)
    cos, sin = precompute_rope(s.head_dim, s.max_seq_len, s.rope_theta)  # (max_seq_len, head_dim/2) each
    with open(path, "wb") as f:
        f.write(header)
        f.write(_f32(weights.embedding))
        for name in ORDER:
            for layer in weights.layers:
                f.write(_f32(layer[name]))
        f.write(_f32(weights.norm))
        f.write(_f32(cos))
        f.write(_f32(sin))


def write_tokenizer_bin(sp_model: Path, path: Path) -> None:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    tokens: list[bytes] = []
    scores: list[float] = []
    for i in range(sp.vocab_size()):
        t = sp.id_to_piece(i)
        if i == sp.bos_id():
            t = "\n<s>\n"
        elif i == sp.eos_id():
            t = "\n</s>\n"
        elif len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            t = chr(int(t[3:5], 16))
        tokens.append(t.replace("▁", " ").encode("utf-8"))
        scores.append(sp.get_score(i))
    with open(path, "wb") as f:
        f.write(struct.pack("<I", max(len(t) for t in tokens)))
        for b, score in zip(tokens, scores):
            f.write(struct.pack("<fI", score, len(b)))
            f.write(b)


def write_llama2c(weights: LlamaWeights, sp_model: Path, out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    write_model_bin(weights, out / "model.bin")
    write_tokenizer_bin(sp_model, out / "tokenizer.bin")
    return ["model.bin", "tokenizer.bin"]
