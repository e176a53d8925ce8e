"""memplan.kernels: memplan's tiled kernels.

- `linear_cross_entropy(hidden, weight, targets, ignore_index=-100, reduction="mean")`: the fused loss
  (tiled PyTorch; docs/kernels.md);
- `apply(model)` / `revert(model)`: train a transformers causal LM (llama, mistral, qwen2, gemma,
  gemma2, gpt2) with it.

The Triton kernels, tiled attention and the tiled MLP come with the rest of their issue.
"""

from .cross_entropy import linear_cross_entropy
from .patch import SUPPORTED, apply, revert

__all__ = ["SUPPORTED", "apply", "linear_cross_entropy", "revert"]
