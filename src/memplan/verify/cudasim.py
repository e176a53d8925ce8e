"""Run a model on the CPU (real or fake tensors) with the memory behaviour it has on a CUDA GPU.

Three things differ between CPU and CUDA that change which tensors a training step keeps, and this
module replays the CUDA side as a `TorchFunctionMode`:

1. Autocast. CUDA autocast's op lists are not CPU autocast's (CPU keeps softmax and layer_norm in half;
   CUDA runs them in fp32), and a CPU-only torch cannot enter CUDA autocast at all. The lists below are
   torch's own: `AT_FORALL_LOWER_PRECISION_FP`, `AT_FORALL_FP32`, `AT_FORALL_FP32_SET_OPT_DTYPE` and
   `AT_FORALL_PROMOTE` in ATen/autocast_mode.h (torch 2.13). Like `cached_cast` there, casts of leaf
   tensors that require grad (the weights) are cached for the autocast region (the forward pass).
2. Dropout. `at::dropout` takes the fused `native_dropout` (1-byte bool mask) only on CUDA; on the CPU it
   multiplies by a float noise tensor (4 bytes per element). Here dropout is always `native_dropout`.
3. Scaled dot-product attention. CUDA picks FlashAttention, then memory-efficient, then the math kernel
   (torch/nn/attention sdp_utils: flash needs sm80+, fp16/bf16, no attn_mask, head_dim <= 256;
   memory-efficient takes fp32 too and a mask, not enable_gqa). Flash and memory-efficient save only the
   output and the log-sum-exp; math saves the s x s probabilities. On fake tensors the CUDA kernels
   themselves run (their meta functions); on real CPU tensors the fused CPU kernel stands in for them
   (it keeps the same tensors; it has no attention dropout, so attention dropout is skipped there).

Everything else (matmuls, norms, losses, optimizers) allocates the same tensors on both devices.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

# ATen/autocast_mode.h, AT_FORALL_LOWER_PRECISION_FP: inputs cast to the half dtype.
LOWER = {"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "addmm", "addbmm", "addmv",
         "addr", "mv", "einsum", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
         "conv_transpose3d", "prelu", "chain_matmul", "scaled_dot_product_attention"}
# AT_FORALL_FP32: floating inputs cast to fp32.
FP32 = {"acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow", "__pow__", "softplus", "layer_norm", "rms_norm", "group_norm", "cosine_similarity",
        "nll_loss", "cross_entropy", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
        "binary_cross_entropy_with_logits", "dist", "cdist", "renorm", "logsumexp"}
# AT_FORALL_FP32_SET_OPT_DTYPE: run with dtype=float32 (fp32 output, no cast copy of the input).
SET_DTYPE_FP32 = {"softmax", "log_softmax", "sum", "prod", "cumsum", "cumprod"}
# AT_FORALL_PROMOTE: inputs cast to the widest floating dtype among them.
PROMOTE = {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "index_put", "tensordot", "scatter_add"}

HALF = (torch.float16, torch.bfloat16)


def _eligible(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def sdpa_kernel(q: torch.Tensor, k: torch.Tensor, attn_mask, sm: tuple[int, int], enable_gqa: bool,
                force: str | None = None, v_dim: int | None = None) -> str:
    """Which CUDA SDPA kernel torch picks for these inputs on a GPU of compute capability `sm`."""
    d = q.shape[-1]
    gqa = enable_gqa and q.shape[-3] != k.shape[-3]
    # flash also needs one head width for q, k and v (torch aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
    # check_head_dim_size_flash); MLA's values are narrower than its queries and keys (DeepSeek-V3: 128 vs 192)
    flash_ok = sm >= (8, 0) and q.dtype in HALF and attn_mask is None and d <= 256 and v_dim in (None, d)
    if force == "flash" and q.dtype in HALF:
        return "flash"
    if flash_ok:
        return "flash"
    eff_ok = sm >= (5, 0) and not gqa and (q.dtype != torch.bfloat16 or sm >= (8, 0))
    return "efficient" if eff_ok else "math"


class CudaSemantics(TorchFunctionMode):
    """CUDA autocast (when `autocast_dtype` is set), native dropout and CUDA's SDPA kernel choice.

    `fake`: tensors are FakeTensors, so the CUDA attention kernels run through their meta functions.
    `autocast` is switched by the caller (on for forward and recompute, off for the optimizer step),
    `cache` for the forward pass only, as torch.autocast's weight-cast cache lives for its region.
    """

    def __init__(self, autocast_dtype: torch.dtype | None, sm: tuple[int, int], fake: bool,
                 force_kernel: str | None = None):
        super().__init__()
        self.dtype = autocast_dtype
        self.sm = sm
        self.fake = fake
        self.force_kernel = force_kernel
        self.autocast = autocast_dtype is not None
        self.cache_enabled = False
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.kernels: dict[str, int] = {}  # SDPA kernel -> calls, reported by verify

    @property
    def emulated_autocast_dtype(self) -> torch.dtype | None:
        """The half dtype while the emulated autocast is on: memplan.kernels cast their inputs once, as
        under torch.autocast (kernels/amp.py)."""
        return self.dtype if self.autocast else None

    def clear_cache(self) -> None:
        self._cache.clear()

    def _to(self, t, dtype):
        if not _eligible(t) or t.dtype == dtype:
            return t
        # ATen's cached_cast: fp32 leaves that require grad and are not views (a slice of one is
        # a leaf with requires_grad inside an autograd.Function's forward, and is not cached)
        if self.cache_enabled and t.is_leaf and t.requires_grad and not t._is_view():
            hit = self._cache.get(id(t))
            if hit is not None and hit[0] is t and hit[1].dtype == dtype:
                return hit[1]
            out = t.to(dtype)
            self._cache[id(t)] = (t, out)
            return out
        return t.to(dtype)

    def _cast_all(self, args, kwargs, dtype):
        cast = lambda x: self._to(x, dtype) if isinstance(x, torch.Tensor) else (  # noqa: E731
            [self._to(y, dtype) for y in x] if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor)
            else x)
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "backward" and len(args) == 1 and not any(kwargs.get(k) for k in ("gradient", "inputs")):
            # A mode is popped while its handler runs, but backward must run under it (checkpointed
            # layers recompute their forward there), so call the engine as Tensor.backward does.
            from torch.autograd.graph import _engine_run_backward

            with self:
                retain = bool(kwargs.get("retain_graph") or kwargs.get("create_graph"))
                _engine_run_backward((args[0],), (torch.ones_like(args[0]),), retain, bool(kwargs.get("create_graph")), (),
                                     allow_unreachable=True, accumulate_grad=True)
            return None
        if name == "dropout":
            return self._dropout(func, args, kwargs)
        if self.autocast:
            if name in LOWER:
                args, kwargs = self._cast_all(args, kwargs, self.dtype)
            elif name in FP32:
                if any(_eligible(a) and a.dtype in HALF for a in args):
                    args, kwargs = self._cast_all(args, kwargs, torch.float32)
            elif name in SET_DTYPE_FP32:
                if args and _eligible(args[0]) and kwargs.get("dtype") is None and not _has_positional_dtype(name, args):
                    kwargs = {**kwargs, "dtype": torch.float32}
            elif name in PROMOTE:
                dts = [a.dtype for a in args if _eligible(a)]
                if torch.float32 in dts and any(d in HALF for d in dts):
                    args, kwargs = self._cast_all(args, kwargs, torch.float32)
        if name == "scaled_dot_product_attention":
            return self._sdpa(func, args, kwargs)
        return func(*args, **kwargs)

    def _dropout(self, func, args, kwargs):
        x = args[0]
        p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
        training = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
        inplace = kwargs.get("inplace", args[3] if len(args) > 3 else False)
        if not training or p == 0 or inplace or not isinstance(x, torch.Tensor) or x.numel() == 0:
            return func(*args, **kwargs)
        if p >= 1:
            return x * 0
        return torch.ops.aten.native_dropout(x, p, True)[0]

    def _sdpa(self, func, args, kwargs):
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        a = dict(zip(names, args))
        a.update(kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        mask, p = a.get("attn_mask"), float(a.get("dropout_p", 0.0))
        causal, scale, gqa = bool(a.get("is_causal", False)), a.get("scale"), bool(a.get("enable_gqa", False))
        kernel = sdpa_kernel(q, k, mask, self.sm, gqa, self.force_kernel, v.shape[-1])
        self.kernels[kernel] = self.kernels.get(kernel, 0) + 1
        if kernel == "math":
            return func(*args, **kwargs)
        if mask is not None and mask.dtype == torch.bool:
            # sdpa turns a boolean mask into an additive one in the query dtype (convert_boolean_attn_mask)
            mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill(~mask, float("-inf"))
        if self.fake and kernel == "flash" and mask is None:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, p, causal, False, scale=scale)[0]
        if self.fake:
            k, v = _expanded(q, k, v)  # efficient has no GQA: torch expands k, v first
            bias = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2]) if mask is not None else None
            return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, p, causal,
                                                                          scale=scale)[0]
        # Real CPU tensors: the fused CPU kernel, kept to what CUDA's kernel keeps (_CpuAttention); it has no dropout.
        if kernel == "efficient":  # CUDA's efficient kernel saves the expanded k, v
            k, v = _expanded(q, k, v)
        return _CpuAttention.apply(q, k, v, mask, causal, scale)


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[-3], dim=-3)


class _CpuAttention(torch.autograd.Function):
    """torch's fused CPU attention with the memory of CUDA's flash / efficient kernels: it saves q, k, v as given
    (CUDA's flash kernel takes grouped k, v natively: the CPU kernel's expanded copies are made again in backward,
    not kept), the output laid out (b, s, heads, d) as CUDA's kernels allocate it (so transformers'
    transpose(1, 2).contiguous() is a view, not a copy) and the log-sum-exp. Gradients are the CPU kernel's."""

    @staticmethod
    def forward(ctx, q, k, v, mask, causal, scale):
        kr, vr = _expanded(q, k, v)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kr, vr, 0.0, causal, attn_mask=mask,
                                                                              scale=scale)
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        kr, vr = _expanded(q, k, v)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, kr, vr, out.contiguous(), lse, 0.0, ctx.causal, attn_mask=mask, scale=ctx.scale)
        group = q.shape[-3] // k.shape[-3]
        if group > 1:  # each kv head's gradient is the sum over its query group (repeat_interleave's backward)
            dk, dv = (g.unflatten(-3, (k.shape[-3], group)).sum(-3) for g in (dk, dv))
        return dq, dk, dv, None, None, None


def _expanded(q, k, v):
    """k and v at the query's heads (the CPU kernel has no grouped-query attention)."""
    if q.shape[-3] == k.shape[-3]:
        return k, v
    return _repeat_kv(k, q.shape[-3]), _repeat_kv(v, q.shape[-3])


def _has_positional_dtype(name: str, args: tuple) -> bool:
    # F.softmax(input, dim, _stacklevel, dtype); Tensor.softmax(dim, dtype); torch.sum(input, dim, keepdim, dtype=)
    return (name in ("softmax", "log_softmax") and len(args) >= 4) or any(isinstance(a, torch.dtype) for a in args)


__all__ = ["CudaSemantics", "sdpa_kernel"]
