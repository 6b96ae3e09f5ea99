"""The base language model every architecture shares: embedding -> schedule of blocks -> final norm -> tied head.

Follows karpathy/llama2.c `Transformer`: token embedding tied with the output head, `n_layers` unique
`Block`s, final RMSNorm, init N(0, 0.02) for every Linear/Embedding with `w3` and `wo` re-drawn from
N(0, 0.02 / sqrt(2 * n_layers)) (llama2.c scales w3, not w2; we keep the quirk, with n_layers = unique blocks).

A subclass says only how its blocks are scheduled (`schedule`), which extra parameters it has
(`build_extra`/`init_extra`), how those count (`components`) and how much compute a token costs
(`flop_terms`). Sharing is one module called in a loop, never aliased copies.

`args` is any object with the fields of `benchctl.config.ModelArgs` (this package does not import benchctl).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from architectures.blocks import (
    IGNORE_INDEX,
    Block,
    KVCache,
    RMSNorm,
    block_forward_flops,
    linear_cross_entropy,
    precompute_rope,
)


class RecurrenceError(ValueError):
    """A test-time recurrence the architecture cannot run (e.g. more passes than it has depth encodings for)."""


Params = nn.Module | nn.Parameter | Iterable[nn.Module | nn.Parameter]


def count(obj: Params) -> int:
    if isinstance(obj, nn.Parameter):
        return obj.numel()
    if isinstance(obj, nn.Module):
        return sum(p.numel() for p in obj.parameters())
    return sum(count(o) for o in obj)


class BaseLM(nn.Module):
    name: ClassVar[str] = ""  # set by @register
    label: ClassVar[str] = ""  # human-readable name for tables and figures
    description: ClassVar[str] = ""

    # ---- class-level hooks used by the config layer ------------------------------------------------------------

    @classmethod
    def default_n_recur(cls, args: Any) -> int:
        """The recurrence the architecture trains with when the config leaves it unset."""
        return 1

    @classmethod
    def max_n_recur(cls, args: Any) -> int | None:
        """The largest recurrence allowed at evaluation (None = unbounded)."""
        return args.n_recur

    @classmethod
    def validate_args(cls, args: Any) -> None:
        """Raise ValueError subclasses (the config layer turns them into errors naming the key)."""

    # ---- construction ----------------------------------------------------------------------------------------------

    def __init__(self, args: Any):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tok_embeddings.weight = self.output.weight  # tied embeddings (one tensor, as in llama2.c)
        self.dropout = nn.Dropout(args.dropout)
        cos, sin = precompute_rope(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.build_extra(args)
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("w3.weight") or pn.endswith("wo.weight"):
                nn.init.normal_(p, mean=0.0, std=args.init_std / math.sqrt(2 * args.n_layers))
        self.init_extra(args)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.args.init_std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.args.init_std)

    def build_extra(self, args: Any) -> None:
        """Create the architecture's own parameters (depth encodings, adapters, LoRA)."""

    def init_extra(self, args: Any) -> None:
        """Initialise them after the llama2.c init has run over every Linear/Embedding."""

    # ---- forward ---------------------------------------------------------------------------------------------------

    def resolve_n_recur(self, n_recur: int | None) -> int:
        if n_recur is None:
            return self.args.n_recur
        if n_recur < 1:
            raise RecurrenceError(f"{self.name}: n_recur must be >= 1, got {n_recur}")
        limit = self.max_n_recur(self.args)
        if limit is not None and n_recur > limit:
            raise RecurrenceError(
                f"{self.name}: n_recur={n_recur} is beyond what this model was built for "
                f"(at most {limit}; it was trained with {self.args.n_recur})"
            )
        return n_recur

    def schedule(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_recur: int, cache: KVCache | None
    ) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        n_recur: int | None = None,
        cache: KVCache | None = None,
        return_logits: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """tokens (B, T) -> logits (B, T, V) and, given targets (B, T), the mean cross-entropy (ignore index -1).

        `return_logits=False` (with targets) returns (None, loss) and computes the loss through the head without
        materialising the logits (`linear_cross_entropy`): what training and validation use.
        """
        B, T = tokens.shape
        n = self.resolve_n_recur(n_recur)
        pos = cache.pos if cache is not None else 0
        if pos + T > self.args.max_seq_len:
            raise ValueError(f"sequence of {pos + T} tokens exceeds the context of {self.args.max_seq_len}")
        cos, sin = self.rope_cos[pos : pos + T], self.rope_sin[pos : pos + T]
        if cache is not None:
            cache.begin()
        h = self.dropout(self.tok_embeddings(tokens))  # (B, T, d)
        h = self.schedule(h, cos, sin, n, cache)
        h = self.norm(h)
        if cache is not None:
            cache.advance(T)
        if targets is not None and not return_logits:
            return None, linear_cross_entropy(h.reshape(B * T, -1), self.output.weight, targets.reshape(-1))
        logits = self.output(h)  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=IGNORE_INDEX)
        return logits, loss

    # ---- accounting ------------------------------------------------------------------------------------------------

    def components(self, n_recur: int) -> list[tuple[str, Params, int]]:
        """(component, parameters, times applied per token at recurrence n_recur), beyond embedding and final norm."""
        return [("blocks", self.layers, 1)]

    def param_report(self, n_recur: int | None = None) -> dict[str, Any]:
        """Unique parameters by component (tied embedding counted once) and effective (unrolled) parameters."""
        n = self.resolve_n_recur(n_recur)
        parts: list[tuple[str, Params, int]] = [("embedding", self.tok_embeddings, 1)]
        parts += self.components(n)
        parts.append(("final_norm", self.norm, 1))
        unique: dict[str, int] = {}
        effective = 0
        for name, obj, uses in parts:
            c = count(obj)
            unique[name] = unique.get(name, 0) + c
            effective += c * uses
        total = sum(p.numel() for p in self.parameters())
        if total != sum(unique.values()):  # a component list that misses a parameter is a bug in the arch file
            raise AssertionError(f"{self.name}: components sum to {sum(unique.values())}, model has {total}")
        return {"components": unique, "total": total, "effective": effective, "n_recur": n}

    def flop_terms(self, n_recur: int, seq_len: int) -> list[tuple[float, bool]]:
        """(forward FLOPs per token, takes part in backward) for each piece of the schedule, head excluded.

        Default: every `Block` in the "blocks" components, times its uses per token. An architecture whose own
        parameters do matmuls (adapters, LoRA) or that runs part of its schedule without gradients overrides this.
        """
        calls = 0
        for name, obj, uses in self.components(n_recur):
            if name == "blocks":
                mods = [obj] if isinstance(obj, nn.Module) else list(obj)
                calls += uses * sum(isinstance(m, Block) for mod in mods for m in mod.modules())
        return [(calls * block_forward_flops(self.args, seq_len), True)]

    def flops_per_token(self, seq_len: int | None = None, n_recur: int | None = None, training: bool = True) -> float:
        """Training FLOPs per token (forward + backward = 3x forward where gradients flow), recurrence included.

        Counted analytically and checked against torch.utils.flop_counter in the tests: every projection and its
        LoRA, the adapter, attention over the full T x T score matrix, and the tied head; elementwise ops and the
        embedding lookup are not counted (the usual convention).
        """
        T = seq_len or self.args.max_seq_len
        n = self.resolve_n_recur(n_recur)
        terms = self.flop_terms(n, T) + [(2.0 * self.args.dim * self.args.vocab_size, True)]
        if not training:
            return float(sum(f for f, _ in terms))
        return float(sum(f * (3 if bwd else 1) for f, bwd in terms))

    # ---- generation ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_id: int | None = None,
        n_recur: int | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample continuations of idx (B, T) with a KV cache. Returns (new tokens (B, <=max_new), lengths (B,)).

        Rows that emit `eos_id` stop (their later tokens are padding, cut by `lengths`, which counts the tokens
        before EOS). When the context is full, the window slides as in llama2.c's sampler (the last max_seq_len
        tokens are re-encoded each step), so generation length is not bounded by the context.
        """
        B = idx.shape[0]
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if max_new_tokens == 0:  # nothing to sample (the loop below needs at least one step)
            return idx.new_zeros(B, 0), torch.zeros(B, dtype=torch.long, device=idx.device)
        max_len = self.args.max_seq_len
        seq = idx
        cache: KVCache | None = KVCache(max_len)
        logits, _ = self(seq[:, -max_len:], n_recur=n_recur, cache=cache)
        if seq.shape[1] >= max_len:
            cache = None  # no room left: slide the window from here on
        out = []
        done = torch.zeros(B, dtype=torch.bool, device=idx.device)
        lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=idx.device)
        for i in range(max_new_tokens):
            next_tok = sample_next(logits[:, -1, :], temperature, top_k, top_p, generator)  # (B,)
            if eos_id is not None:
                newly = (next_tok == eos_id) & ~done
                lengths[newly] = i
                done |= newly
            out.append(next_tok)
            if bool(done.all()) or i == max_new_tokens - 1:
                break
            seq = torch.cat([seq, next_tok[:, None]], dim=1)
            if cache is not None and cache.pos < max_len:
                logits, _ = self(next_tok[:, None], n_recur=n_recur, cache=cache)
            else:
                cache = None
                logits, _ = self(seq[:, -max_len:], n_recur=n_recur)
        new = torch.stack(out, dim=1)
        return new, torch.minimum(lengths, torch.tensor(new.shape[1], device=idx.device))


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Temperature, then top-k, then nucleus (top-p) filtering of logits (B, V); removed entries become -inf."""
    logits = logits.float() / temperature
    if top_k is not None and 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = F.softmax(sorted_logits, dim=-1)
        remove = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One token per row from logits (B, V): greedy at temperature 0, else top-k / nucleus sampling."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = F.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
