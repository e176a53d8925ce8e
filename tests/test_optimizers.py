"""memplan.verify.optimizers: every rules.OPTIMIZERS name builds a real optimizer; the bnb replicas
match bitsandbytes' state layout and track torch AdamW; all of it runs under FakeTensorMode."""

import sys
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.verify.optimizers import KNOWN, AdamW8bitReplica, Lion8bitReplica, build_optimizer, dynamic_map
from memplan.estimator.rules import OPTIMIZERS


def tiny_model():
    # 64x128 weight (8192 >= min_8bit_size: 8-bit states) and a 100-element bias (32-bit states)
    return torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Tanh(), torch.nn.Linear(64, 100))


def two_steps(opt, model):
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 128)).pow(2).mean().backward()
        opt.step()


def test_names_match_rules():
    assert set(KNOWN) == set(OPTIMIZERS)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_name_builds_and_steps(name):
    torch.manual_seed(0)
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = build_optimizer(name, model.parameters(), momentum=0.9, lr=1e-2, use_bnb=False)
    two_steps(opt, model)
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_name_steps_under_fake_tensor_mode(name):
    with FakeTensorMode():
        model = tiny_model()
        opt = build_optimizer(name, model.parameters(), momentum=0.9, use_bnb=False)
        two_steps(opt, model)
        states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        assert all(isinstance(v, FakeTensor) for v in states)


def test_unknown_name_lists_known():
    with pytest.raises(ValueError, match="adamw_torch_fused.*sgd"):
        build_optimizer("adamw_9bit", [torch.nn.Parameter(torch.zeros(2))])


def test_torch_and_transformers_arguments():
    ps = [torch.nn.Parameter(torch.zeros(4))]
    assert build_optimizer("adamw_torch", ps).defaults["foreach"] is True
    assert build_optimizer("adamw_torch_fused", ps).defaults["fused"] is True
    assert build_optimizer("sgd", ps, momentum=0.9).defaults["momentum"] == 0.9
    assert build_optimizer("rmsprop", ps, momentum=0.5).defaults["momentum"] == 0.5
    # transformers trainer_optimizer._get_adafactor: scale_parameter=False, relative_step=False, lr given
    d = build_optimizer("adafactor", ps, lr=3e-4).defaults
    assert (d["lr"], d["scale_parameter"], d["relative_step"], d["warmup_init"]) == (3e-4, False, False, False)


def test_bnb_classes_used_when_importable(monkeypatch):
    made = []

    def cls(name):
        return lambda params, **kw: made.append((name, kw)) or name

    names = ["AdamW8bit", "PagedAdamW8bit", "PagedAdamW32bit", "Lion", "Lion8bit", "PagedLion", "PagedLion8bit"]
    monkeypatch.setitem(sys.modules, "bitsandbytes",
                        types.SimpleNamespace(optim=types.SimpleNamespace(**{n: cls(n) for n in names})))
    expect = {"adamw_bnb_8bit": "AdamW8bit", "adamw_8bit": "AdamW8bit", "paged_adamw_8bit": "PagedAdamW8bit",
              "paged_adamw_32bit": "PagedAdamW32bit", "lion_32bit": "Lion", "lion_8bit": "Lion8bit",
              "paged_lion_32bit": "PagedLion", "paged_lion_8bit": "PagedLion8bit"}
    for optim, bnb_cls in expect.items():
        assert build_optimizer(optim, [], lr=2e-4) == bnb_cls
        kw = made[-1][1]
        assert kw["lr"] == 2e-4 and kw["betas"] == (0.9, 0.999) and ("eps" in kw) == ("adam" in optim)
    assert isinstance(build_optimizer("lion_8bit", [torch.nn.Parameter(torch.zeros(2))], use_bnb=False),
                      Lion8bitReplica)


def test_use_bnb_true_requires_bitsandbytes(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` raise ImportError
    with pytest.raises(ImportError):
        build_optimizer("adamw_8bit", [torch.nn.Parameter(torch.zeros(2))], use_bnb=True)
    assert isinstance(build_optimizer("adamw_8bit", [torch.nn.Parameter(torch.zeros(2))]), AdamW8bitReplica)


def bnb_create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
    """bitsandbytes/functional.py create_dynamic_map, transcribed (list-based, as upstream)."""
    data = []
    non_sign_bits = total_bits - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                             else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data.append(0)
    data.append(1.0)
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_is_bnb_map(signed):
    code = dynamic_map(signed)
    assert code.dtype == torch.float32 and code.shape == (256,)
    assert torch.equal(code, bnb_create_dynamic_map(signed))
    assert code.max() == 1.0 and (code.min() < -0.99 if signed else code.min() == 0.0)


def test_adamw_replica_state_layout_is_bnb_layout():
    weight = torch.nn.Parameter(torch.randn(64, 128))
    bias = torch.nn.Parameter(torch.randn(100))
    other = torch.nn.Parameter(torch.randn(4096))
    opt = AdamW8bitReplica([weight, bias, other])
    for p in (weight, bias, other):
        p.grad = torch.randn_like(p)
    opt.step()
    w, b = opt.state[weight], opt.state[bias]
    # Optimizer2State.init_state, 8-bit branch, block_wise=True, percentile_clipping=100, max_unorm=0
    assert list(w) == ["step", "state1", "qmap1", "state2", "qmap2", "absmax1", "absmax2"]
    assert w["step"] == 1 and isinstance(w["step"], int)
    for k in (1, 2):
        assert (w[f"state{k}"].dtype, w[f"state{k}"].shape) == (torch.uint8, (64, 128))
        assert (w[f"qmap{k}"].dtype, w[f"qmap{k}"].shape) == (torch.float32, (256,))
        assert (w[f"absmax{k}"].dtype, w[f"absmax{k}"].shape) == (torch.float32, (8192 // 256,))
    assert torch.equal(w["qmap1"], dynamic_map(True)) and torch.equal(w["qmap2"], dynamic_map(False))
    # one map per optimizer, shared by all parameters (Optimizer8bit.name2qmap)
    assert opt.state[other]["qmap1"] is w["qmap1"] and opt.state[other]["absmax1"].shape == (16,)
    # numel < min_8bit_size (4096): fp32 states, no map, no absmax
    assert list(b) == ["step", "state1", "state2"]
    assert all((b[k].dtype, b[k].shape) == (torch.float32, (100,)) for k in ("state1", "state2"))


def test_lion_replica_and_32bit_layouts():
    weight = torch.nn.Parameter(torch.randn(64, 128, dtype=torch.bfloat16))
    lion = Lion8bitReplica([weight])
    adam32 = AdamW8bitReplica([weight], optim_bits=32)
    weight.grad = torch.randn_like(weight)
    lion.step()
    adam32.step()
    # Optimizer1State.init_state: state1/qmap1 (signed)/absmax1 only
    s = lion.state[weight]
    assert list(s) == ["step", "state1", "qmap1", "absmax1"]
    assert (s["state1"].dtype, s["absmax1"].shape) == (torch.uint8, (32,))
    # 32-bit states are fp32 even for a bf16 parameter (get_state_buffer(p, dtype=torch.float32))
    assert all(adam32.state[weight][k].dtype == torch.float32 for k in ("state1", "state2"))


def test_blockwise_roundtrip_error_within_half_code_gap():
    torch.manual_seed(0)
    opt = AdamW8bitReplica([torch.nn.Parameter(torch.zeros(1000))], min_8bit_size=1)
    p = opt.param_groups[0]["params"][0]
    p.grad = torch.zeros_like(p)
    opt.step()
    state = opt.state[p]
    x = torch.randn(1024)
    x[:1000] *= torch.logspace(-4, 0, 1000)  # values spanning several decades
    x[1000:] = 0.0
    for k, vals in ((1, x), (2, x.abs())):
        buf = vals.clone()
        opt._store(state, k, buf)
        back, _ = opt._load(state, k)
        absmax = vals.view(-1, 256).abs().amax(1)
        assert torch.allclose(state[f"absmax{k}"][:3], absmax[:3])
        # nearest code: error <= half the widest gap of the map (0.9/64/2 ~ 0.00703) times the block absmax;
        # reached exactly by a block's -absmax element (no -1.0 code: it maps to -0.9930), hence the 1e-4 slack
        gap = (dynamic_map(k == 1).diff().max() / 2).item()
        err = (back - vals[:1000]).abs().view(-1)
        assert (err <= gap * (1 + 1e-4) * absmax.repeat_interleave(256)[:1000]).all()
        if k == 1:
            assert ((back < 0) == (vals[:1000] < 0)).all()  # state1 keeps its sign (kernels.cu)


def regression_run(make, steps=20):
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    y = x @ (torch.randn(128, 64) / 8).T + 0.01 * torch.randn(256, 128)
    torch.manual_seed(1)
    model = torch.nn.Linear(64, 128)  # 8192-element weight: 8-bit states; 128-element bias: 32-bit
    start = model.weight.detach().clone()
    opt = make(model.parameters())
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.weight.detach(), start, losses


def test_replica_tracks_torch_adamw():
    lr, steps = 1e-2, 20
    ref, start, ref_losses = regression_run(lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0))
    w32, _, _ = regression_run(lambda ps: AdamW8bitReplica(ps, lr=lr, weight_decay=0.0, optim_bits=32))
    w8, _, losses = regression_run(lambda ps: AdamW8bitReplica(ps, lr=lr, weight_decay=0.0))
    # With 32-bit states the replica's update is torch's AdamW (same formula, fp32 rounding only).
    assert (w32 - ref).abs().max() < 1e-5
    # 8-bit states: the only difference is the quantisation of m and v (<= 0.7% of each block's absmax
    # per step, relatively more for elements far below their block's max).  Each Adam step moves a
    # weight by at most ~lr, so the drift is bounded by steps*lr; measured: mean |diff| ~2% of the mean
    # distance travelled, max ~9% of steps*lr.  And the quantisation must be real (diff > fp32 noise).
    moved = (ref - start).abs().mean()
    diff = (w8 - ref).abs()
    assert diff.mean() < 0.05 * moved
    assert 1e-4 < diff.max() < 0.2 * steps * lr
    assert losses[-1] < 0.2 * losses[0]
    assert abs(losses[-1] - ref_losses[-1]) < 0.02 * ref_losses[-1]


class MaxAlloc(TorchDispatchMode):
    """Largest tensor any op returns (a fresh temporary or an in-place result)."""

    def __init__(self):
        super().__init__()
        self.max_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.max_bytes = max(self.max_bytes, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("cls", [AdamW8bitReplica, Lion8bitReplica])
def test_replica_temporaries_at_most_one_fp32_parameter(cls):
    weight = torch.nn.Parameter(torch.randn(100, 130, dtype=torch.bfloat16))  # 13000: not whole blocks
    small = torch.nn.Parameter(torch.randn(300))
    opt = cls([weight, small])
    for p in (weight, small):
        p.grad = torch.randn_like(p)
    opt.step()  # state allocation happens here, outside the measured step
    with MaxAlloc() as mode:
        opt.step()
    assert mode.max_bytes <= 4 * (-(-weight.numel() // 256) * 256)


@pytest.mark.parametrize("cls", [AdamW8bitReplica, Lion8bitReplica])
def test_replica_step_under_fake_tensor_mode(cls):
    with FakeTensorMode():
        weight = torch.nn.Parameter(torch.randn(64, 128))
        bias = torch.nn.Parameter(torch.randn(100))
        opt = cls([weight, bias])
        for _ in range(2):
            weight.grad, bias.grad = torch.randn_like(weight), torch.randn_like(bias)
            opt.step()
        s = opt.state[weight]
        assert isinstance(s["state1"], FakeTensor) and s["state1"].dtype == torch.uint8
        assert s["absmax1"].shape == (32,) and s["step"] == 2
        assert opt.state[bias]["state1"].dtype == torch.float32
