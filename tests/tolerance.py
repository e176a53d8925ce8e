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


def assert_patch_keeps_loss_and_grads(model, x, patch):
    """A causal LM's loss and parameter gradients on tokens `x`, before and after `patch(model)` (memplan.kernels
    .apply with some kernels on): equal to fp32 summation-order noise (rel 1e-5 / 1e-4, abs 1e-6)."""
    params = list(model.parameters())

    def loss_and_grads():
        loss = model(input_ids=x, labels=x).loss
        return loss.detach(), torch.autograd.grad(loss, params, allow_unused=True)

    base, base_g = loss_and_grads()
    patch(model)
    got, got_g = loss_and_grads()
    torch.testing.assert_close(got, base, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_g, base_g):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
