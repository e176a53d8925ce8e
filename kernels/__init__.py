"""memplan.kernels: memplan's tiled kernels.

`linear_cross_entropy(hidden, weight, targets, ignore_index=-100, reduction="mean")` is the fused loss
(tiled PyTorch; the Triton kernel, tiled attention and the tiled MLP come with the rest of their issue).
"""

from .cross_entropy import linear_cross_entropy

__all__ = ["linear_cross_entropy"]
