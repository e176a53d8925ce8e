"""memplan.kernels: memplan's tiled kernels (docs/kernels.md). Each has a Triton implementation for CUDA
and a tiled PyTorch one for the CPU and as the fallback, chosen by `backend="auto"`.

- `linear_cross_entropy(hidden, weight, targets, ...)`: the fused LM head + loss, no b*s x V logits;
- `tiled_attention(q, k, v, causal=..., key_padding_mask=...)` (memplan.kernels.attention.attention):
  tiled (flash-style) attention, GQA / MQA; `register()` makes it transformers' attn_implementation
  "memplan";
- `tiled_mlp(fn, x, params)` / `patch_mlp(module)`: an MLP over chunks of tokens, recomputed in backward;
  `gated_act(gate, up)`: act(gate) * up saving only its inputs;
- `apply(model, loss=True, mlp=True, attention=False)` / `revert(model)`: train a transformers model
  with them (the model types in `SUPPORTED`: the families whose `Family.kernels` holds,
  memplan/estimator/families.py).
"""

from .attention import attention as tiled_attention  # `attention` stays the submodule's name
from .attention import register
from .cross_entropy import linear_cross_entropy
from .mlp import gated_act, patch_mlp, tiled_mlp, unpatch_mlp
from .patch import SUPPORTED, applied, apply, revert

__all__ = ["SUPPORTED", "applied", "apply", "gated_act", "linear_cross_entropy", "patch_mlp", "register", "revert",
           "tiled_attention", "tiled_mlp", "unpatch_mlp"]
