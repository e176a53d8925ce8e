"""Real optimizers for memplan's verification run (a short measured training run).

`build_optimizer(name, params)` maps the names in `memplan.estimator.rules.OPTIMIZERS` to the
optimizer a Hugging Face `Trainer` would build for `optim=name`, so that the tensors
it allocates can be measured.

Sources:

* transformers 5.23, ``transformers/trainer_optimizer.py`` (installed source) and
  ``Trainer.get_optimizer_cls_and_kwargs`` in ``trainer.py``: every optimizer gets
  ``lr``; AdamW/bnb-AdamW also ``betas=(adam_beta1, adam_beta2)``, ``eps=adam_epsilon``
  (defaults 0.9, 0.999, 1e-8); ``adamw_torch_fused`` adds ``fused=True``; bnb Lion
  gets ``betas=(adam_beta1, adam_beta2)``; ``_get_adafactor`` adds
  ``scale_parameter=False, relative_step=False`` (``warmup_init`` keeps its default,
  False); sgd/adagrad/rmsprop get only ``lr`` unless ``optim_args`` say otherwise.
  Weight decay comes from the parameter groups (``args.weight_decay``, default 0.0).
* bitsandbytes (github.com/bitsandbytes-foundation/bitsandbytes, main branch):
  ``bitsandbytes/optim/optimizer.py`` (``Optimizer8bit.fill_qmap``,
  ``get_state_buffer``, ``Optimizer2State.init_state``/``Optimizer1State.init_state``),
  ``bitsandbytes/functional.py`` (``create_dynamic_map``), ``csrc/ops.cu``
  (``BLOCKSIZE_2STATE 256``, ``BLOCKSIZE_1STATE 256``) and ``csrc/kernels.cu``
  (``kOptimizerStatic8bit2StateBlockwise``, ``kOptimizerStatic8bit1StateBlockwise``,
  ``quantize_2D``).

bitsandbytes is a dependency (QLoRA), but its optimizers cannot step fake tensors: the fake trace
(``use_bnb=False``) and any run without bitsandbytes map the bnb names to
`AdamW8bitReplica` / `Lion8bitReplica`, plain-torch classes that allocate the same
state tensors as bnb and perform a real blockwise-quantised update. They step one
parameter at a time; each temporary is at most one parameter's fp32 size (rounded up
to whole 256-element blocks), and at most three are alive at once (plus an fp32 copy
of the gradient when it is not fp32, and 1-byte masks). Real bnb runs fused kernels
with no temporaries, so the replica's transient peak is higher than bnb's.
Paged variants allocate the same bytes but the replica does not page: bnb allocates
paged states of >= 1e5 elements with ``cudaMallocManaged`` (``F.get_paged``), outside
PyTorch's caching allocator, and lets the driver spill them to CPU memory.

Everything avoids ``.item()``, branches on tensor values and data-dependent shapes,
so it also runs under ``torch._subclasses.fake_tensor.FakeTensorMode``.
"""

from __future__ import annotations

import math

import torch

# BNB_BLOCK = 256: csrc/ops.cu #define BLOCKSIZE_2STATE 256 / BLOCKSIZE_1STATE 256, and
# optimizer.py init_state: blocks = n // 256 (+1 for a remainder).
# BNB_MIN_8BIT_SIZE = 4096: Optimizer2State/Optimizer1State(min_8bit_size=4096).
from memplan.estimator.rules import BNB_BLOCK, BNB_MIN_8BIT_SIZE

__all__ = ["build_optimizer", "AdamW8bitReplica", "Lion8bitReplica", "dynamic_map", "KNOWN"]
# Index of the 0.0 code in the sorted signed map: 127 negative codes precede it
# (create_dynamic_map: 2 * (1 + 2 + ... + 64) = 254 fraction codes, then 0 and 1.0).
_SIGNED_ZERO = 127


def dynamic_map(signed: bool = True, device=None) -> torch.Tensor:
    """bitsandbytes ``functional.create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)``.

    256 sorted fp32 codes in [-1, 1] (signed) or [0, 1] (unsigned), built with tensor
    ops (no ``.tolist()``) so that it also works under FakeTensorMode.
    """
    parts = [torch.zeros(1, device=device), torch.ones(1, device=device)]  # data.append(0); data.append(1.0)
    for i in range(7):
        items = 2**i + 1 if signed else 2 ** (i + 1) + 1
        bounds = torch.linspace(0.1, 1, items, device=device)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        parts.append((10 ** (-6 + i)) * means)
        if signed:
            parts.append(-(10 ** (-6 + i)) * means)
    return torch.cat(parts).sort().values


UPDATE_CHUNK = 1024 * BNB_BLOCK  # elements per update slice (whole quantisation blocks; 1 MiB of fp32)


def _slice_state(state: dict, a: int, b: int) -> dict:
    """Views of one parameter's state for elements [a, b): states by element, absmax by block."""
    out = {}
    for k, v in state.items():
        if k.startswith("state") and isinstance(v, torch.Tensor):
            out[k] = v.view(-1)[a:b]
        elif k.startswith("absmax"):
            out[k] = v[a // BNB_BLOCK: -(-b // BNB_BLOCK)]
        else:
            out[k] = v
    return out


class _BnbReplica(torch.optim.Optimizer):
    """Shared state layout and blockwise (de)quantisation; subclasses define `_update`."""

    n_states = 2

    def __init__(self, params, defaults, optim_bits=8, min_8bit_size=BNB_MIN_8BIT_SIZE, is_paged=False):
        if optim_bits not in (8, 32):
            raise ValueError(f"optim_bits must be 8 or 32, got {optim_bits}")
        super().__init__(params, defaults)
        self.optim_bits = optim_bits
        self.min_8bit_size = min_8bit_size
        self.is_paged = is_paged  # recorded only: the replica never pages
        self._qmaps: dict = {}  # bnb Optimizer8bit.name2qmap: one map per optimizer, shared by all params

    def _qmap(self, signed: bool, device):
        key = (signed, str(device))
        if key not in self._qmaps:
            code = dynamic_map(signed, device)
            self._qmaps[key] = (code, (code[:-1] + code[1:]) / 2)  # codes and decision midpoints
        return self._qmaps[key]

    def _init_state(self, p, state):
        # Mirrors Optimizer2State/Optimizer1State.init_state (bitsandbytes/optim/optimizer.py).
        state["step"] = 0  # state["step"] = 0: a Python int, not a tensor
        if self.optim_bits == 32 or p.numel() < self.min_8bit_size:
            # dtype = torch.float32 when optim_bits == 32 or p.numel() < min_8bit_size;
            # get_state_buffer -> zeros_like(p, dtype=float32): fp32 even for bf16/fp16 params.
            for k in range(1, self.n_states + 1):
                state[f"state{k}"] = torch.zeros_like(p, dtype=torch.float32)
            return
        for k in range(1, self.n_states + 1):
            # state{k} = get_state_buffer(p, dtype=torch.uint8): one byte per element, p's shape.
            state[f"state{k}"] = torch.zeros_like(p, dtype=torch.uint8)
            # qmap1 = name2qmap["dynamic"] (signed), qmap2 = name2qmap["udynamic"] (unsigned):
            # 256 fp32 codes from create_dynamic_map, moved to p.device.
            state[f"qmap{k}"] = self._qmap(k == 1, p.device)[0]
        blocks = -(-p.numel() // BNB_BLOCK)  # blocks = n // 256 + (1 if n % 256 > 0 else 0)
        for k in range(1, self.n_states + 1):
            # absmax{k} = torch.zeros((blocks,), dtype=torch.float32): one scale per block.
            state[f"absmax{k}"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)

    def _load(self, state, k):
        """State k as fp32 of p's shape: the fp32 state itself, or a dequantised copy (padded to whole blocks)."""
        s = state[f"state{k}"]
        if s.dtype == torch.float32:
            return s, None
        absmax = state[f"absmax{k}"]
        zero = _SIGNED_ZERO if k == 1 else 0  # pad with the index of code 0.0
        idx = torch.full((absmax.numel() * BNB_BLOCK,), zero, dtype=torch.int32, device=s.device)
        idx[: s.numel()].copy_(s.reshape(-1))
        buf = state[f"qmap{k}"][idx]  # code lookup, fp32, padded length
        del idx
        buf.view(-1, BNB_BLOCK).mul_(absmax.view(-1, 1))
        return buf[: s.numel()].view(s.shape), buf

    def _store(self, state, k, buf):
        """Requantise a padded fp32 buffer into state k (in place; `buf` is overwritten)."""
        if buf is None:  # fp32 state was updated in place
            return
        s, absmax = state[f"state{k}"], state[f"absmax{k}"]
        mids = self._qmap(k == 1, s.device)[1]
        blocks = buf.view(-1, BNB_BLOCK)
        # kernels.cu: new_local_abs_max = block max of |s|, stored in absmax[i / BLOCK_SIZE].
        torch.maximum(blocks.amax(1), blocks.amin(1).neg(), out=absmax)
        # bnb divides by absmax unguarded; an all-zero block stays zero whatever its codes.
        blocks.div_(torch.where(absmax > 0, absmax, torch.ones_like(absmax)).view(-1, 1))
        # quantize_2D: nearest code, ties to the lower one == count of midpoints < x.
        idx = torch.searchsorted(mids, buf, out_int32=True)
        if k == 1:
            # kernels.cu keeps state1's sign: a negative value that rounded to 0.0 takes the
            # smallest negative code instead (c1s[j] -= 1).
            idx.masked_fill_((buf < 0) & (idx == _SIGNED_ZERO), _SIGNED_ZERO - 1)
        s.view(-1).copy_(idx[: s.numel()])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
                n = p.numel()
                if n <= UPDATE_CHUNK:
                    self._update(p, p.grad.float(), state, group)  # .float(): no copy when already fp32
                    continue
                # bitsandbytes updates in one fused kernel with no temporaries; slicing the update into
                # whole 256-element blocks keeps this replica's temporaries to a few hundred KiB too.
                flat_p, flat_g = p.view(-1), p.grad.view(-1)
                for a in range(0, n, UPDATE_CHUNK):
                    b = min(a + UPDATE_CHUNK, n)
                    self._update(flat_p[a:b], flat_g[a:b].float(), _slice_state(state, a, b), group)
        return loss


class AdamW8bitReplica(_BnbReplica):
    """bitsandbytes ``AdamW(optim_bits=8)`` / ``AdamW8bit`` (``optim_bits=32``: ``AdamW32bit``).

    Same state tensors as bnb; the update follows ``kOptimizerStatic8bit2StateBlockwise``:
    ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``,
    ``p += -lr sqrt(1-b2^t)/(1-b1^t) * m / (sqrt(v) + eps sqrt(1-b2^t))``, then
    ``p *= 1 - lr wd``; m and v are requantised blockwise to the nearest code.
    """

    n_states = 2

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 optim_bits=8, min_8bit_size=BNB_MIN_8BIT_SIZE, is_paged=False):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, optim_bits, min_8bit_size, is_paged)

    def _update(self, p, grad, state, group):
        (b1, b2), lr, eps, wd, t = group["betas"], group["lr"], group["eps"], group["weight_decay"], state["step"]
        m, m_buf = self._load(state, 1)
        v, v_buf = self._load(state, 2)
        m.mul_(b1).add_(grad, alpha=1 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        correction1 = 1 - b1**t
        correction2 = math.sqrt(1 - b2**t)
        upd = v.sqrt().add_(eps * correction2)
        torch.div(m, upd, out=upd)
        p.add_(upd, alpha=-lr * correction2 / correction1)
        del upd
        if wd > 0:
            p.mul_(1 - lr * wd)
        del m, v
        self._store(state, 1, m_buf)
        del m_buf
        self._store(state, 2, v_buf)


class Lion8bitReplica(_BnbReplica):
    """bitsandbytes ``Lion(optim_bits=8)`` / ``Lion8bit`` (``optim_bits=32``: ``Lion``); one state.

    Update as ``kOptimizerStatic8bit1StateBlockwise`` (LION): ``p *= 1 - lr wd``,
    ``p -= lr sign(b1 m + (1-b1) g)``, ``m = b2 m + (1-b2) g``, m requantised blockwise.
    """

    n_states = 1

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0,
                 optim_bits=8, min_8bit_size=BNB_MIN_8BIT_SIZE, is_paged=False):
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        super().__init__(params, defaults, optim_bits, min_8bit_size, is_paged)

    def _update(self, p, grad, state, group):
        (b1, b2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
        m, m_buf = self._load(state, 1)
        if wd > 0:
            p.mul_(1 - lr * wd)
        upd = m.mul(b1).add_(grad, alpha=1 - b1).sign_()
        p.add_(upd, alpha=-lr)
        del upd
        m.mul_(b2).add_(grad, alpha=1 - b2)
        del m
        self._store(state, 1, m_buf)


# name -> (bitsandbytes.optim class, replica class, replica kwargs)
_BNB = {
    "adamw_bnb_8bit": ("AdamW8bit", AdamW8bitReplica, dict(optim_bits=8)),
    "adamw_8bit": ("AdamW8bit", AdamW8bitReplica, dict(optim_bits=8)),
    "paged_adamw_8bit": ("PagedAdamW8bit", AdamW8bitReplica, dict(optim_bits=8, is_paged=True)),
    "paged_adamw_32bit": ("PagedAdamW32bit", AdamW8bitReplica, dict(optim_bits=32, is_paged=True)),
    "lion_32bit": ("Lion", Lion8bitReplica, dict(optim_bits=32)),
    "lion_8bit": ("Lion8bit", Lion8bitReplica, dict(optim_bits=8)),
    "paged_lion_32bit": ("PagedLion", Lion8bitReplica, dict(optim_bits=32, is_paged=True)),
    "paged_lion_8bit": ("PagedLion8bit", Lion8bitReplica, dict(optim_bits=8, is_paged=True)),
}
_TORCH = ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop")
KNOWN = tuple(sorted(_TORCH + tuple(_BNB)))

# Trainer defaults: adam_beta1, adam_beta2, adam_epsilon (transformers TrainingArguments).
_BETAS, _EPS = (0.9, 0.999), 1e-8


def _bnb_optim():
    try:
        import bitsandbytes
    except ImportError:
        return None
    return bitsandbytes.optim


def build_optimizer(name: str, params, *, momentum: float = 0.0, lr: float = 1e-4,
                    weight_decay: float = 0.0, use_bnb: bool | None = None) -> torch.optim.Optimizer:
    """The optimizer HF Trainer builds for ``optim=name`` (see module docstring).

    ``momentum`` applies to sgd and rmsprop (memplan's ``momentum_arg``).
    ``use_bnb``: None uses bitsandbytes when importable, else the replicas; True
    requires bitsandbytes; False always uses the replicas.
    """
    if name not in KNOWN:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(KNOWN)}")
    adam = dict(lr=lr, betas=_BETAS, eps=_EPS, weight_decay=weight_decay)
    if name == "adamw_torch":
        return torch.optim.AdamW(params, foreach=True, **adam)
    if name == "adamw_torch_fused":
        return torch.optim.AdamW(params, fused=True, **adam)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False,
                         weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, weight_decay=weight_decay)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, momentum=momentum, weight_decay=weight_decay)

    bnb_name, replica, extra = _BNB[name]
    kwargs = adam if "adam" in name else dict(lr=lr, betas=_BETAS, weight_decay=weight_decay)
    bnb = _bnb_optim() if use_bnb is not False else None
    if use_bnb and bnb is None:
        raise ImportError(f"use_bnb=True but bitsandbytes is not importable (optimizer {name!r})")
    if bnb is not None:
        return getattr(bnb, bnb_name)(params, **kwargs)
    return replica(params, **kwargs, **extra)
