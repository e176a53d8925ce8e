"""memplan.kernels: memplan's tiled kernels (fused linear cross-entropy, tiled attention, tiled MLP).

The kernels arrive with their own issue; this package exists now so that the installed layout
(`memplan`, `memplan.kernels`, `memplan.profiles`) is fixed from the start. It exports nothing yet.
"""

__all__: list[str] = []
