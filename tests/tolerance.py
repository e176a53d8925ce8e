"""The kernels' tolerance rule (docs/kernels.md), shared by their tests.

fp32: equal to the reference to rel 1e-5 plus 1e-6 of the largest value (the same sums in another order).
Low precision: both are compared with an fp64 computation from the same inputs; the kernel's error may be
at most twice the reference's own error, plus one bf16 ulp (2^-8 relative) of the largest value.
"""

import torch


def assert_within_own_error(got, ref, exact, names=None):
    """Each tensor of `got` against `exact`, allowed twice `ref`'s error plus one bf16 ulp."""
    names = names or [str(i) for i in range(len(exact))]
    for x, y, z, name in zip(got, ref, exact, names, strict=True):
        assert x.dtype == y.dtype, (name, x.dtype, y.dtype)
        ulp = 2.0 ** -8 * z.abs().max().item()
        err, err_ref = (x.double() - z).abs().max().item(), (y.double() - z).abs().max().item()
        assert err <= 2 * err_ref + ulp, (name, err, err_ref, ulp)
