"""The fast paths of the zoo: the same maths as the reference code in `blocks.py`, arranged into fewer, larger kernels.

- `LoRAProjection`: a group of projections sharing one input plus their LoRA deltas, with each low-rank product
  accumulated straight into its slice of the output (and of the input gradient) instead of through concatenations
  and full-size additions. `blocks.project_group` uses it; `blocks.lora_delta` is the plain-autograd reference.
- `linear_cross_entropy`: the head's loss computed a chunk of rows at a time, without materialising the logits;
  the reference is `F.cross_entropy(F.linear(h, weight).float(), targets, ignore_index=-1)`.
- `rms_norm`: RMSNorm with a shorter backward, written straight in the dtype of the matmul it feeds under autocast;
  the reference is llama2.c's `(x * rsqrt(mean(x^2) + eps)) * weight`.
- `swiglu`: the feed-forward's gate silu(a) * b, with both halves' gradients written into one tensor (the input's
  layout) instead of concatenated after the fact; the reference is `F.silu(a) * b`.
- `causal_attention`: causal self-attention over a whole sequence; on a CPU at short sequence lengths written as two
  batched matmuls and a softmax accumulated in float32, because there PyTorch's fused kernel has a slow backward; the
  reference is `F.scaled_dot_product_attention(q, k, v, is_causal=True)`.

Each runs exactly the matmuls autograd would (the same FLOPs, counted the same way); the tests compare each with
its reference. Each change here was measured with `benchctl bench`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch


def when_dynamo_loads(callback: Callable[[], None]) -> None:
    """Run `callback` once torch._dynamo is imported: now if it is, else right after its import.

    For what must be made with `torch.compiler.disable` (a function left out of torch.compile's graphs): making it
    imports torch._dynamo, seconds that every process importing the architectures would pay, while only a process
    that compiles needs it, and that one imports dynamo before it traces anything. The callback runs after the
    module's own code, before the import statement that loaded it returns."""
    if "torch._dynamo" in sys.modules:
        callback()
        return
    _DYNAMO_WAITING.append(callback)
    if not any(isinstance(f, _AfterDynamoImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterDynamoImport())


_DYNAMO_WAITING: list[Callable[[], None]] = []


class _AfterDynamoImport(importlib.abc.MetaPathFinder):
    """Finds torch._dynamo as the other finders would, and has its loader run the waiting callbacks after it."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_call(module: Any) -> None:
            exec_module(module)
            waiting = list(_DYNAMO_WAITING)
            _DYNAMO_WAITING.clear()
            for callback in waiting:
                callback()

        loader.exec_module = exec_then_call  # type: ignore[method-assign]
        return spec


IGNORE_INDEX = -1  # targets equal to this are left out of the loss (llama2.c's ignore_index)


class LoRAProjection(torch.autograd.Function):
    """y = x W^T + [s u_1 B_1^T | ... | s u_n B_n^T] with u = x A^T, for n projections sharing x (N, in).

    W (O, in) and A (n r, in) are the group's stacked weights; B_j (o_j, r). Forward and backward run exactly the
    matmuls autograd would (the same FLOPs, counted the same way), but each low-rank product is accumulated straight
    into its slice of the output, and A's share of the input gradient straight into it (addmm with out=), instead of
    through concatenations and separate full-size additions.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, scale: float, *bs: torch.Tensor
    ) -> torch.Tensor:
        y, u = lora_projection(x, w, a, scale, *bs)
        ctx.save_for_backward(x, w, a, u, *bs)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, a, u, *bs = ctx.saved_tensors
        r = bs[0].shape[1]
        gy = gy.contiguous()  # (N, O)
        du = torch.empty_like(u)  # d(x A^T), (N, n r)
        dbs = []
        col = 0
        for j, b in enumerate(bs):
            g = gy[:, col : col + b.shape[0]]  # (N, o_j)
            dbs.append(torch.mm(g.t(), u[:, j * r : (j + 1) * r]))  # (o_j, r); u carries the scale
            torch.mm(g, b, out=du[:, j * r : (j + 1) * r])
            col += b.shape[0]
        if ctx.scale != 1.0:
            du.mul_(ctx.scale)
        da = torch.mm(du.t(), x)  # (n r, in)
        dw = torch.mm(gy.t(), x)  # (O, in)
        dx = torch.mm(gy, w)  # (N, in)
        torch.addmm(dx, du, a, out=dx)  # dx += du A
        return (dx, dw, da, None, *dbs)


def lora_projection(
    x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, scale: float, *bs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`LoRAProjection`'s forward without autograd: (y (N, O), u = s x A^T (N, n r)). Called directly at inference,
    where no gradient is needed and the Function's bookkeeping would cost more than these small matmuls."""
    r = bs[0].shape[1]
    u = torch.mm(x, a.t())  # (N, n r)
    if scale != 1.0:
        u.mul_(scale)
    y = torch.mm(x, w.t())  # (N, O)
    col = 0
    for j, b in enumerate(bs):
        ys = y[:, col : col + b.shape[0]]
        torch.addmm(ys, u[:, j * r : (j + 1) * r], b.t(), out=ys)  # ys += s u_j B_j^T
        col += b.shape[0]
    return y, u


# ---- RMSNorm ---------------------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """llama2.c's RMSNorm of float32 x (..., d): x * rsqrt(mean(x^2) + eps) * weight, written in `out_dtype`
    (default float32).

    Under autocast a norm that feeds a matmul is cast to the autocast dtype by that matmul; writing it in that dtype
    here saves the cast's pass forward and backward, and `RMSNormFunction`'s backward takes the shorter way through
    the normalisation's derivative. The forward values are bitwise llama2.c's (one rounding from float32). Under
    torch.compile the plain expression, which inductor fuses.
    """
    out_dtype = out_dtype or x.dtype
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        # compiling: inductor fuses the plain expression; inference mode: no gradient can be asked for, so the
        # fused kernel without the Function's bookkeeping
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps).to(out_dtype)
    return RMSNormFunction.apply(x, weight, eps, out_dtype)


# On a CPU, RMSNorm works through blocks of rows of about this many float32 bytes, each block's passes (the norm, its
# products, and backward the four passes of its derivative) running while the block is in cache, instead of each pass
# streaming a whole activation tensor through memory again.
CPU_NORM_BLOCK_BYTES = 1 << 20


class RMSNormFunction(torch.autograd.Function):
    """y = xhat * w with xhat = x * rstd, rstd = (mean(x^2) + eps)^(-1/2); backward
    dx = rstd * (gy w - xhat * mean(gy w xhat)), dw = sum over rows of gy xhat. Saves xhat (as autograd would) and
    rstd. On a CPU the rows are processed in cache-sized blocks (CPU_NORM_BLOCK_BYTES), each row's arithmetic the
    same as over the whole tensor."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
        d = x.shape[-1]
        x2 = x.reshape(-1, d)
        rows = _norm_block_rows(x2)
        rstd = torch.empty(x2.shape[0], 1, dtype=x.dtype, device=x.device)
        xhat = torch.empty_like(x2)
        y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        for r in range(0, x2.shape[0], rows):
            b = slice(r, r + rows)
            torch.rsqrt(x2[b].pow(2).mean(-1, keepdim=True).add_(eps), out=rstd[b])
            torch.mul(x2[b], rstd[b], out=xhat[b])
            torch.mul(xhat[b], weight, out=y[b])  # computed in float32, rounded once to out_dtype
        ctx.save_for_backward(xhat, rstd, weight)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xhat, rstd, weight = ctx.saved_tensors
        g2 = gy.reshape(xhat.shape)
        rows = _norm_block_rows(xhat)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = torch.empty_like(xhat) if need_x else None
        dw = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        for r in range(0, xhat.shape[0], rows):
            b = slice(r, r + rows)
            gxhat = g2[b] * weight  # float32
            if dw is not None:
                dw += (g2[b] * xhat[b]).sum(0)
            if dx is not None:
                dot = (gxhat * xhat[b]).mean(-1, keepdim=True)
                torch.addcmul(gxhat, xhat[b], dot, value=-1, out=dx[b]).mul_(rstd[b])
        return (
            dx.view(gy.shape) if dx is not None else None,
            dw.to(weight.dtype) if dw is not None else None,
            None,
            None,
        )


def _norm_block_rows(x2: torch.Tensor) -> int:
    if x2.device.type != "cpu":
        return max(1, x2.shape[0])
    return max(1, CPU_NORM_BLOCK_BYTES // (x2.element_size() * x2.shape[1]))


# ---- the feed-forward's gate ----------------------------------------------------------------------------------------


def swiglu(h13: torch.Tensor) -> torch.Tensor:
    """silu(a) * b for h13 = [a | b] (..., 2h), the output of the feed-forward's fused w1|w3 projection: (..., h).

    Under torch.compile the plain expression (inductor fuses it); otherwise `SwiGLU`, whose backward writes both
    halves' gradients into one (..., 2h) tensor instead of two that autograd then concatenates for the fused
    projection's backward.
    """
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or not h13.requires_grad:
        a, b = h13.chunk(2, dim=-1)
        return torch.nn.functional.silu(a) * b
    return SwiGLU.apply(h13)


class SwiGLU(torch.autograd.Function):
    """silu(a) * b for h13 = [a | b]; saves what autograd would (h13 and silu(a)) and runs the same elementwise
    kernels, with each half's gradient written into its slice of one gradient tensor."""

    @staticmethod
    def forward(ctx: Any, h13: torch.Tensor) -> torch.Tensor:
        a, b = h13.chunk(2, dim=-1)
        sa = torch.nn.functional.silu(a)
        ctx.save_for_backward(h13, sa)
        return sa * b

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor]:
        h13, sa = ctx.saved_tensors
        a, b = h13.chunk(2, dim=-1)
        d = torch.empty_like(h13)
        da, db = d.chunk(2, dim=-1)
        torch.mul(g, sa, out=db)  # d/db = g silu(a)
        torch.ops.aten.silu_backward.grad_input(g * b, a, grad_input=da)  # d/da = g b silu'(a)
        return (d,)


# ---- attention ------------------------------------------------------------------------------------------------------

# On a CPU, attention in bf16 over sequences up to this length runs as explicit matmuls: at short lengths they beat
# PyTorch's CPU flash-attention kernel, forward and backward, while from about twice this length on the fused kernel
# is as fast or faster, and in float32 it is faster at every length.
CPU_EXPLICIT_ATTENTION_MAX_T = 128
# The explicit form works through the (batch x head) rows in chunks whose scores take about this many bytes, so that
# scores, probabilities and their gradients stay in cache whatever the batch size (at T = 128 in bf16: 32 rows; the
# size is not critical within a factor of two).
CPU_ATTENTION_CHUNK_BYTES = 1 << 20


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd) + causal mask) v for whole sequences q, k, v (B, H, T, hd): the function
    `F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)` computes, which is what runs on
    GPUs, in float32 and for longer sequences. On a CPU in bf16 up to CPU_EXPLICIT_ATTENTION_MAX_T positions: per
    chunk of rows, the scores of (q / sqrt(hd)) k^T as one batched matmul, masked, softmaxed with float32
    accumulation, and the probabilities times v as another matmul; scores and probabilities are held in bf16, as the
    matmuls round them anyway (outputs and gradients agree with the fused kernel's to within bf16 rounding: tests).
    Under torch.compile the same form, written whole for inductor to fuse."""
    B, H, T, hd = q.shape
    explicit = (
        q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and 1 < T <= CPU_EXPLICIT_ATTENTION_MAX_T
    )
    if not explicit:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=T > 1)
    if torch.compiler.is_compiling():
        # the same two matmuls and softmax written plainly, whole: inductor fuses the scale, the mask and the softmax
        # around them itself, and the chunked Function's writes into slices would break its graph (the fused kernel
        # there made a compiled bf16 step slower than the eager one; this form does not)
        q, k, v = ((q * hd**-0.5).reshape(B * H, T, hd), k.reshape(B * H, T, hd), v.reshape(B * H, T, hd))
        probs = torch.softmax(torch.bmm(q, k.transpose(1, 2)) + _future_mask(T, q), dim=-1)
        if dropout_p > 0.0:
            probs = torch.nn.functional.dropout(probs, dropout_p)
        return torch.bmm(probs, v).view(B, H, T, hd)
    # the scale folded into q (a pass over q instead of over the T x T scores); the mask added in place to the scores
    # in their own dtype; the softmax reads bf16 and accumulates in float32 (PyTorch's CPU kernel), writing the bf16
    # probabilities the second matmul needs. Its backward then runs in one pass too, where float32 scores took four
    # (casts both ways, the softmax's backward, the scale).
    rows = max(1, CPU_ATTENTION_CHUNK_BYTES // (q.element_size() * T * T))
    q, k, v = ((q * hd**-0.5).reshape(B * H, T, hd), k.reshape(B * H, T, hd), v.reshape(B * H, T, hd))
    if dropout_p == 0.0:
        return ChunkedCausalAttention.apply(q, k, v, rows).view(B, H, T, hd)
    future = _future_mask(T, q)
    outs = []
    for qc, kc, vc in zip(q.split(rows), k.split(rows), v.split(rows)):
        probs = torch.softmax(torch.bmm(qc, kc.transpose(1, 2)).add_(future), dim=-1)
        outs.append(torch.bmm(torch.nn.functional.dropout(probs, dropout_p), vc))
    return torch.cat(outs).view(B, H, T, hd)


def _future_mask(T: int, like: torch.Tensor) -> torch.Tensor:
    """(T, T): -inf above the diagonal (key after query), 0 elsewhere, in `like`'s dtype and device."""
    return torch.full((T, T), float("-inf"), dtype=like.dtype, device=like.device).triu_(1)


class ChunkedCausalAttention(torch.autograd.Function):
    """softmax(q k^T + causal mask) v for pre-scaled q and k, v (BH, T, hd), `rows` of BH at a time: the matmuls and
    softmax autograd would run on the same chunks, with each chunk's output and gradients written into place in
    whole-size tensors (autograd would concatenate the chunks forward and backward). Saves q, k, v and the bf16
    probabilities."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int) -> torch.Tensor:
        future = _future_mask(q.shape[1], q)
        out = torch.empty_like(q)
        probs = []
        for s in range(0, q.shape[0], rows):
            c = slice(s, s + rows)
            p = torch.softmax(torch.bmm(q[c], k[c].transpose(1, 2)).add_(future), dim=-1)  # (rows, T, T)
            torch.bmm(p, v[c], out=out[c])
            probs.append(p)
        ctx.save_for_backward(q, k, v, *probs)
        ctx.rows = rows
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, *probs = ctx.saved_tensors
        g = g.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for p, s in zip(probs, range(0, q.shape[0], ctx.rows)):
            c = slice(s, s + ctx.rows)
            torch.bmm(p.transpose(1, 2), g[c], out=dv[c])
            ds = torch._softmax_backward_data(torch.bmm(g[c], v[c].transpose(1, 2)), p, -1, p.dtype)  # d scores
            torch.bmm(ds, k[c], out=dq[c])
            torch.bmm(ds.transpose(1, 2), q[c], out=dk[c])
        return dq, dk, dv, None


# ---- the head and its loss ------------------------------------------------------------------------------------------


def linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """Mean cross-entropy of the logits h W^T (N, V) against targets (N,), without ever holding all the logits.

    The same function as `F.cross_entropy(F.linear(h, weight).float(), targets, ignore_index=-1)`, evaluated `chunk`
    rows at a time. With gradients needed (training), each chunk's gradient is formed while its logits are in cache
    (softmax minus one-hot) and pushed through the head's two backward matmuls at once (`LinearCrossEntropy`): the same
    three matmuls autograd would run, but no (N, V) logits, log-softmax or gradient tensors written to memory and read
    back, and none held through the rest of the backward pass. h (N, d), weight (V, d), targets (N,) with -1 ignored.
    `chunk` rows per step: by default 8 MB of float32 logits (512 rows at V = 4096), at least 128 rows.
    """
    if h.device.type == "cpu" and torch.compiler.is_compiling():
        return _eager_linear_cross_entropy(h, weight, targets, chunk)
    return _linear_cross_entropy(h, weight, targets, chunk)


def _linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """`linear_cross_entropy` itself (which decides only whether torch.compile may trace it)."""
    if chunk is None:
        chunk = max(128, (1 << 21) // weight.shape[0])
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return LinearCrossEntropy.apply(h, weight, targets, chunk)
    total, n_valid = _chunked_cross_entropy(h, weight, targets, chunk, None, None)
    return total / n_valid


# Under torch.compile on a CPU the loss runs as written, between the compiled graphs of the model's body: its chunk
# loop is already the fast form of the head there (the compiled step with it left eager beats the eager step), and its
# host-side check of the targets would break the graph at the first chunk anyway. Used only while compiling, so made
# when dynamo loads (see when_dynamo_loads); until then it is the function itself.
_eager_linear_cross_entropy: Callable[..., torch.Tensor] = _linear_cross_entropy


def _disable_loss() -> None:
    global _eager_linear_cross_entropy
    _eager_linear_cross_entropy = torch.compiler.disable(_linear_cross_entropy)


when_dynamo_loads(_disable_loss)


def compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype an op on h computes in: autocast's on h's device when it is on, else h's own."""
    dev = h.device.type
    if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return h.dtype


# On a CPU the float32 softmax of a chunk's logits, and the gradient formed from it, are worked through blocks of rows
# of about this many bytes, so that each block stays in cache from the softmax to the gradient's write (a whole
# chunk's float32 logits, megabytes at the default chunk size, would fall out of cache between the two).
CPU_LOSS_BLOCK_BYTES = 1 << 20


def _chunked_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    grad_h: torch.Tensor | None,
    grad_w: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, number of counted targets); with grad_h (N, d) / grad_w (V, d) given, also fills them with the
    gradient of the *summed* loss (the caller scales by 1 / n_valid)."""
    cd = compute_dtype(h)
    autocast_off = torch.autocast(h.device.type, enabled=False) if h.device.type in ("cpu", "cuda") else nullcontext()
    with autocast_off:  # the dtypes are chosen here, as autocast would (matmuls in cd, softmax in float32)
        hc_all, w = h.to(cd), weight.to(cd)
        valid = targets != IGNORE_INDEX
        total = torch.zeros((), device=h.device, dtype=torch.float32)
        accumulate_w = grad_w is not None and grad_w.dtype == cd  # addmm_ needs one dtype
        need_grad = grad_h is not None or grad_w is not None
        on_cpu = h.device.type == "cpu"
        # on a CPU, knowing that no target is ignored saves a pass over every chunk (the check would cost a GPU a sync)
        mask_rows = not on_cpu or not bool(valid.all())
        block = max(1, CPU_LOSS_BLOCK_BYTES // (4 * w.shape[0])) if on_cpu else chunk
        for s in range(0, h.shape[0], chunk):
            hc, vc = hc_all[s : s + chunk], valid[s : s + chunk]
            idx = targets[s : s + chunk].clamp(min=0).unsqueeze(1)  # (n, 1); ignored rows point at 0, masked below
            logits = torch.mm(hc, w.t())  # (n, V) in cd
            # the gradient (softmax minus one-hot) in cd, for the backward matmuls; float32 logits are softmaxed
            # straight into it, lower precisions through a float32 block
            g = torch.empty_like(logits) if need_grad else None
            for r in range(0, logits.shape[0], block):
                rows = slice(r, r + block)
                out = g[rows] if g is not None and cd == torch.float32 else None
                p, logp_t = softmax_and_target_logp(logits[rows].float(), idx[rows], out=out)  # (b, V), (b,)
                total -= torch.where(vc[rows], logp_t, 0.0).sum()
                if g is None:
                    continue
                p.scatter_add_(1, idx[rows], torch.where(vc[rows], -1.0, 0.0).unsqueeze(1))  # softmax minus one-hot
                if mask_rows:
                    p.mul_(vc[rows].unsqueeze(1))  # ignored rows contribute nothing
                if out is None:
                    g[rows] = p
            if g is None:
                continue
            if grad_h is not None:
                torch.mm(g, w, out=grad_h[s : s + chunk])  # grad_h is allocated in cd
            if grad_w is not None:
                if accumulate_w:
                    grad_w.addmm_(g.t(), hc)
                else:
                    grad_w += g.t() @ hc
    return total, valid.sum()


# Below this probability a target's log-probability is taken from the logits instead: float32 softmax entries lose
# precision as they approach the subnormal range, and reach 0 for targets ~104 nats below the best logit.
_TINY_PROB = 1e-30


def softmax_and_target_logp(
    logits: torch.Tensor, idx: torch.Tensor, check_tiny: bool | None = None, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(logits) (n, V) and log_softmax(logits)[i, idx[i]] (n,), for float32 logits (n, V) and idx (n, 1);
    the softmax is written into `out` (float32, (n, V)) when given.

    With `check_tiny` (the default on a CPU): the softmax in one pass, and the targets' log-probabilities as the log
    of its gathered entries, accurate to float32 rounding while they are normal numbers; rows whose target entry is
    below _TINY_PROB (a model very sure of another token) get the exact log-softmax of their logits. On a CPU this
    replaces a log-softmax and an exp over all the logits (the exp alone costing more than the softmax). Finding
    those rows needs the host to look at the data, which would cost a GPU a synchronisation per chunk; there
    (`check_tiny=False`) the log-softmax is computed and exponentiated in place, exact for every row.
    """
    if check_tiny is None:
        check_tiny = logits.device.type == "cpu"
    if not check_tiny:
        logp = torch.log_softmax(logits, dim=-1)
        logp_t = logp.gather(1, idx).squeeze(1)
        return (logp.exp_() if out is None else torch.exp(logp, out=out)), logp_t
    p = torch.softmax(logits, dim=-1) if out is None else torch.softmax(logits, dim=-1, out=out)
    p_t = p.gather(1, idx).squeeze(1)
    logp_t = p_t.log()
    tiny = p_t < _TINY_PROB
    if bool(tiny.any()):
        rows = tiny.nonzero().squeeze(1)
        exact = logits[rows].gather(1, idx[rows]).squeeze(1) - torch.logsumexp(logits[rows], dim=-1)
        logp_t = logp_t.index_put((rows,), exact)
    return p, logp_t


class LinearCrossEntropy(torch.autograd.Function):
    """Forward of `linear_cross_entropy` that also computes its gradients (see there); backward only scales them."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty(h.shape, dtype=compute_dtype(h), device=h.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        total, n_valid = _chunked_cross_entropy(h, weight, targets, chunk, grad_h, grad_w)
        inv = 1.0 / n_valid.float()  # nan loss when every target is ignored, as F.cross_entropy
        ctx.save_for_backward(*(t for t in (grad_h, grad_w, inv) if t is not None))
        ctx.need = (need_h, need_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        return total * inv

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = list(ctx.saved_tensors)
        scale = grad_out * saved.pop()  # d loss / d (summed loss) = grad_out / n_valid
        (need_h, need_w), (h_dtype, w_dtype) = ctx.need, ctx.dtypes
        # out of place: the saved gradients stay valid for a second backward (retain_graph)
        grad_h = (saved.pop(0) * scale).to(h_dtype) if need_h else None
        grad_w = (saved.pop(0) * scale).to(w_dtype) if need_w else None
        return grad_h, grad_w, None, None
