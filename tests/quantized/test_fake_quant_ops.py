"""``fxq::observe_fake_quantize``: the fused QAT fake-quant step equals the unfused modules.

The op's torch definition is checked against ``FakeQuantize`` + its observer on the CPU;
its Triton kernels under Triton's interpreter (``TRITON_INTERPRET=1``, a fresh process:
the variable is read when the kernels are defined) on the CPU, and on CUDA when present.
Equal means bit for bit: outputs, gradients, statistics, scales.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import fxq
from fxq.fake_quantize import FakeQuantize
from fxq.observer import (
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
)
from fxq.quantized import fake_quant_ops
from fxq.quantized.fake_quant_ops import Statistics
from tests.helpers import run_in_fresh_process

#: (observer, its keyword arguments, input shape, statistics mode)
CASES = {
    "moving": (MovingAverageMinMaxObserver, {}, (8, 16, 9, 9), Statistics.MOVING),
    "frozen": (MovingAverageMinMaxObserver, {"averaging_constant": 0.0}, (4, 5000), None),
    "running": (MinMaxObserver, {}, (8, 16, 9, 9), Statistics.RUNNING),
    "weight": (PerChannelMinMaxObserver, {"ch_axis": 0}, (16, 8, 3, 3), Statistics.LATEST),
    "moving per channel": (
        MovingAveragePerChannelMinMaxObserver,
        {"ch_axis": 0},
        (16, 3000),
        Statistics.MOVING,
    ),
    "int16": (MovingAverageMinMaxObserver, {"dtype": "qint16"}, (3, 7000), Statistics.MOVING),
}


def _fake_quant(name: str) -> FakeQuantize:
    observer, kw, shape, _ = CASES[name]
    kw = dict(kw)
    if "ch_axis" in kw:
        kw["num_channels"] = shape[kw["ch_axis"]]
    return FakeQuantize(observer=observer, march="bayes", **kw)


def _inputs(name: str, step: int, device) -> torch.Tensor:
    """Inputs of growing range; a channels_last one (per tensor), one with zeros."""
    _, kw, shape, _ = CASES[name]
    g = torch.Generator().manual_seed(step)
    x = torch.randn(shape, generator=g) * (step + 1)
    if step == 2 and len(shape) == 4 and "ch_axis" not in kw:
        x = x.contiguous(memory_format=torch.channels_last)
    if step == 3:
        x.view(-1)[:5] = 0.0
    return x.to(device)


def compare_steps(name: str, device, steps: int = 4) -> None:
    """``steps`` QAT steps of a fake quant with the fused op and of a copy without it
    (``torch_ops_only``) that always applies the gradient mask (the fused op skips it where
    the statistics bound the input); asserts every number equal."""
    fq = _fake_quant(name).to(device)
    ref = copy.deepcopy(fq)
    ref._clips_gradient = lambda: True
    for step in range(steps):
        x = _inputs(name, step, device).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        assert fq._fused_statistics(x) is not None
        out = fq(x)
        with fake_quant_ops.torch_ops_only():
            assert ref._fused_statistics(x_ref) is None
            expected = ref(x_ref)
        grad = torch.randn_like(out)
        out.backward(grad)
        expected.backward(grad)
        assert torch.equal(out, expected), (name, step)
        assert torch.equal(x.grad, x_ref.grad), (name, step)
        for key, value in ref.state_dict().items():
            assert torch.equal(fq.state_dict()[key], value), (name, step, key)


@pytest.mark.parametrize("name", CASES)
def test_the_ops_torch_definition_equals_the_modules(name):
    """The op on the CPU (its torch definition), called directly, against the modules."""
    fq = _fake_quant(name)
    ref = copy.deepcopy(fq)
    obs = fq.activation_post_process
    mode = CASES[name][3] or Statistics.MOVING
    for step in range(4):
        x = _inputs(name, step, "cpu")
        out = fake_quant_ops.observe_fake_quantize(
            x, obs.min_val, obs.max_val, fq.scale, obs.non_finite, None,
            getattr(obs, "averaging_constant", 0.0), mode, fq.levels_above_zero,
            fq.dtype.qmin, fq.dtype.qmax, fq.ch_axis,
        )  # fmt: skip
        assert torch.equal(out, ref(x))
        assert torch.equal(obs.min_val, ref.activation_post_process.min_val)
        assert torch.equal(fq.scale, ref.scale)
    assert float(obs.non_finite) == 0.0


def test_the_op_is_one_node_for_torch_compile():
    """The fake kernel gives shapes, so a graph capture records the op as one node."""
    fq = _fake_quant("moving")
    obs = fq.activation_post_process

    def step(x):
        return fake_quant_ops.observe_fake_quantize(
            x, obs.min_val, obs.max_val, fq.scale, obs.non_finite, None, 0.01,
            Statistics.MOVING, 127, -128, 127, None,
        )  # fmt: skip

    x = torch.randn(4, 8)
    explained = torch._dynamo.explain(step)(x)
    assert explained.graph_break_count == 0
    ops = [n.target for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.fxq.observe_fake_quantize.default in ops


_INTERPRETED = """
import warnings
warnings.simplefilter("ignore")
from tests.quantized.test_fake_quant_ops import CASES, FoldNet, compare_steps, compare_training
for name in CASES:
    compare_steps(name, "cpu")
compare_training("cpu")
compare_training("cpu", FoldNet)
print("equal")
"""


def test_the_triton_kernels_equal_the_modules_interpreted():
    """The Triton kernels, run by Triton's interpreter on the CPU, against the modules (the
    reference runs in ``torch_ops_only`` blocks)."""
    pytest.importorskip("triton")
    assert run_in_fresh_process(_INTERPRETED, TRITON_INTERPRET="1") == "equal"


_LAUNCHES = """
from fxq.quantized import _fake_quant_triton as kernels
from tests.quantized.test_fake_quant_ops import CASES, _fake_quant, _inputs

launched = []


class Counted:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launched.append(self.kernel.fn.__name__)
        return self.kernel[grid]

    def __getattr__(self, name):  # the parameters' names, for the launcher
        return getattr(self.kernel, name)


for launcher in (kernels._launch_observe, kernels._launch_rows, kernels._launch_fake_quant):
    launcher.kernel = Counted(launcher.kernel)
for case in CASES:
    launched.clear()
    _fake_quant(case)(_inputs(case, 0, "cpu").requires_grad_())
    print(case.replace(" ", "_"), *launched)
"""


def test_a_fused_step_launches_two_kernels_per_tensor_and_one_per_channel_interpreted():
    """A weight's (per-channel) step is one program per channel that also rounds its row; a
    per-tensor step needs the whole tensor's range before it rounds: two launches."""
    pytest.importorskip("triton")
    lines = run_in_fresh_process(_LAUNCHES, TRITON_INTERPRET="1").splitlines()
    launches = {line.split()[0]: line.split()[1:] for line in lines}
    per_tensor = ["_observe_kernel", "_fake_quant_kernel"]
    assert launches == {
        "moving": per_tensor,
        "frozen": per_tensor,
        "running": per_tensor,
        "weight": ["_rows_kernel"],
        "moving_per_channel": ["_rows_kernel"],
        "int16": per_tensor,
    }


class FoldNet(torch.nn.Module):
    """BatchNorms to fold of every kind: without affine parameters after a conv with a bias,
    with a gamma of 0 (a channel that folds with 1), a negative one and a tiny one."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(6, affine=False)
        self.conv2 = torch.nn.Conv2d(6, 6, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(6)
        with torch.no_grad():
            self.bn2.weight[:3] = torch.tensor([0.0, -0.7, 1e-39])
        self.fc = torch.nn.Linear(6, 10)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


def compare_training(device, net: type[torch.nn.Module] | None = None, steps: int = 3) -> None:
    """QAT training steps of a small CNN with the fused op and without: every output, loss
    and state-dict entry equal, and the NaN / Inf flag raised by the same step. Each
    BatchNorm is folded into its conv by the weight's fused step (``fold_qat_forward``).
    ``net``: the network's class (``tests.helpers.ResidualNet`` by default)."""
    from tests.helpers import ResidualNet

    fxq.set_march("bayes")
    torch.manual_seed(0)
    float_model = (net or ResidualNet)()
    model = fxq.prepare_qat_fx(float_model, {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig})
    model.to(device).train()
    fxq.set_fake_quantize(model, fxq.FakeQuantState.QAT)
    ref = copy.deepcopy(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref)]
    labels = torch.arange(6, device=device) % 10
    kernels = fake_quant_ops._triton()
    fold = kernels.fold_observe_fake_quantize
    folds = []
    kernels.fold_observe_fake_quantize = lambda *args: folds.append(1) or fold(*args)
    try:
        for step in range(steps):
            x = torch.randn(6, 3, 10, 10, generator=torch.Generator().manual_seed(step))
            x = x.to(device)
            losses = []
            for m, opt, context in zip(
                (model, ref), optimizers, (contextlib.nullcontext, fake_quant_ops.torch_ops_only)
            ):
                opt.zero_grad()
                with context():
                    loss = torch.nn.functional.cross_entropy(m(x), labels)
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            assert torch.equal(losses[0], losses[1]), step
    finally:
        kernels.fold_observe_fake_quantize = fold
    batchnorms = sum(isinstance(m, torch.nn.BatchNorm2d) for m in float_model.modules())
    assert len(folds) == batchnorms * steps
    for key, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    fxq.set_fake_quantize(model, fxq.FakeQuantState.VALIDATION)
    fxq.set_fake_quantize(ref, fxq.FakeQuantState.VALIDATION)
    x = torch.randn(2, 3, 10, 10, device=device)
    assert torch.equal(model(x), ref(x))
    fxq.set_fake_quantize(model, fxq.FakeQuantState.QAT)
    bad = torch.randn(6, 3, 10, 10, device=device)
    bad[0, 0, 0, 0] = float("nan")
    model(bad)
    with pytest.raises(ValueError, match=r"observer of .* saw NaN or Inf"):
        fxq.set_fake_quantize(model, fxq.FakeQuantState.VALIDATION)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("name", CASES)
def test_the_triton_kernels_equal_the_modules_on_cuda(name):
    compare_steps(name, torch.device("cuda"))


@needs_cuda
@pytest.mark.parametrize("net", [None, FoldNet], ids=["ResidualNet", "FoldNet"])
def test_qat_training_with_the_fused_op_equals_the_torch_ops_on_cuda(net):
    compare_training(torch.device("cuda"), net)


@needs_cuda
def test_a_fused_qat_fake_quant_step_launches_at_most_two_kernels():
    """torch.ao's fused op is one op of a few kernels; fxq's QAT step was 16-20 kernels: now
    two per tensor, one per channel (a weight)."""
    from torch.profiler import ProfilerActivity, profile

    for name, most in (("moving", 2), ("weight", 1)):
        fq = _fake_quant(name).cuda()
        x = _inputs(name, 0, "cuda")
        fq(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fq(x)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(kernels) <= most, (name, [e.name for e in kernels])


@needs_cuda
def test_a_large_tensor_gathers_every_programs_statistics_on_cuda():
    """1024 programs meet in the scratch; the last one must see every other's min and max
    (a race would show as a scale off the unfused one's in some of the calls)."""
    fq = _fake_quant("moving").cuda()
    ref = copy.deepcopy(fq)
    for step in range(20):
        x = torch.randn(32, 64, 56, 56, device="cuda") * (1 + step % 3)
        x.view(-1)[torch.randint(0, x.numel(), (1,)).item()] = 40.0 + step  # the max, anywhere
        out = fq(x)
        with fake_quant_ops.torch_ops_only():
            expected = ref(x)
        assert torch.equal(fq.activation_post_process.max_val, ref.activation_post_process.max_val)
        assert torch.equal(fq.scale, ref.scale), step
        assert torch.equal(out, expected)


def test_the_fused_step_follows_a_new_offset_in_its_gradient_clipping(monkeypatch):
    """The fused step remembers per fake quant whether it clips gradients (checked at every
    step otherwise) and learns it again when the grid changes: a running min / max on a
    signed grid never clips; shifted to an unsigned grid (offset 128) it clips negatives.
    The Triton launch is replaced by a stub whose mask says every value was clamped."""
    import types

    def clamped_everywhere(x, *args):
        return x.detach().clone(), torch.zeros_like(x, dtype=torch.bool)

    monkeypatch.setattr(fake_quant_ops, "triton_usable", lambda x: True)
    monkeypatch.setattr(
        fake_quant_ops,
        "_triton",
        lambda: types.SimpleNamespace(observe_fake_quantize=clamped_everywhere),
    )
    fq = _fake_quant("running")
    fq.set_fake_quant_state("qat")
    grads = []
    for step in range(3):
        if step == 2:
            fq.set_offset(128)
        x = _inputs("running", step, "cpu").requires_grad_()
        assert fq._fused_statistics(x) is Statistics.RUNNING
        fq(x).sum().backward()
        grads.append(float(x.grad.abs().sum()))
    assert grads[0] == grads[1] == x.numel() and grads[2] == 0.0


def test_the_fold_joins_the_weights_launch_only_where_the_fake_quant_runs_as_called(monkeypatch):
    """``fold_qat_forward`` takes a training BatchNorm's fold into the weight's launch; not
    for a fake quant with a hook (the hook would not run), under a global module hook, in
    VALIDATION or once the BatchNorm statistics are frozen: those fold with torch ops and
    call the fake quant. The Triton kernels are replaced by stubs that count their calls."""
    import types

    from tests.helpers import ResidualNet

    calls = {"fold": 0, "fake quant": 0}

    def fake_quant(x, *args):
        calls["fake quant"] += 1
        return x.detach().clone(), torch.ones_like(x, dtype=torch.bool)

    def fold(w, gamma, running_var, *args):
        calls["fold"] += 1
        ones = torch.ones_like(running_var)
        return w.detach().clone(), torch.ones_like(w, dtype=torch.bool), ones, ones

    stubs = types.SimpleNamespace(observe_fake_quantize=fake_quant, fold_observe_fake_quantize=fold)
    fxq.set_march("bayes")
    model = fxq.prepare_qat_fx(ResidualNet(), {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig})
    model.train()
    fxq.set_fake_quantize(model, fxq.FakeQuantState.QAT)
    monkeypatch.setattr(fake_quant_ops, "triton_usable", lambda x: True)
    monkeypatch.setattr(fake_quant_ops, "_triton", lambda: stubs)
    x = torch.randn(2, 3, 8, 8)

    def run() -> tuple[int, int]:
        calls.update({"fold": 0, "fake quant": 0})
        model(x).sum().backward()
        return calls["fold"], calls["fake quant"]

    activations = run()[1]  # each conv's weight folded in its launch: 3 folds
    assert run() == (3, activations)
    seen = []
    hooked = model.stem.weight_fake_quant.register_forward_hook(lambda *a: seen.append(a))
    assert run() == (2, activations + 1) and len(seen) == 1
    hooked.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert run() == (0, activations + 3)
    finally:
        handle.remove()
    fxq.qat.freeze_bn_stats(model)
    assert run() == (0, activations + 3)
    fxq.qat.update_bn_stats(model)
    assert run() == (3, activations)
    fxq.set_fake_quantize(model, fxq.FakeQuantState.VALIDATION)
    with torch.no_grad():
        model(x)
    assert calls["fold"] == 3  # VALIDATION neither observes nor folds in the launch


_PTX = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fxq.quantized import _fake_quant_triton as kernels

def ptx(fn, **constexprs):
    signature = {}
    for p in fn.params:
        name = p.name
        if p.is_constexpr:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*i1" if name == "mask_ptr" else "*fp32"
        else:
            signature[name] = "i32" if name in ("n", "row_length") else "fp32"
    values = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    source = ASTSource(fn=fn, signature=signature, constexprs=values)
    target = GPUTarget("cuda", 90, 32)
    return triton.compile(source, target=target, options=kernels._OPTIONS).asm["ptx"]

out = {}
for fold, gamma in ((True, True), (True, False), (False, False)):
    out[f"rows fold={fold} gamma={gamma}"] = ptx(
        kernels._rows_kernel, MODE=0, FOLD=fold, HAS_GAMMA=gamma, BLOCK=1024
    )
out["observe"] = ptx(kernels._observe_kernel, MODE=0, HAS_FALLBACK=True, BLOCK=1024)
out["fake quant"] = ptx(kernels._fake_quant_kernel, BLOCK=1024)
print(json.dumps({k: [v.count(op) for op in ("fma.", "sqrt.rn.f32", "sqrt.approx", "div.rn.f32", "div.full")] for k, v in out.items()}))
"""


def test_the_kernels_compile_for_a_gpu_with_torchs_float_operations():
    """Compiled for an sm_90 GPU by Triton (no GPU needed): no fused multiply-add, the
    fold's square root and every division correctly rounded, as torch's CUDA kernels compute
    them; the interpreter's tests cannot see this (numpy rounds every operation)."""
    pytest.importorskip("triton")
    import json

    counts = json.loads(run_in_fresh_process(_PTX))
    for name, (fma, sqrt_rn, sqrt_approx, div_rn, div_full) in counts.items():
        assert fma == 0 and sqrt_approx == 0 and div_full == 0, (name, counts[name])
        assert div_rn > 0, name
        assert sqrt_rn == (1 if name.startswith("rows fold=True") else 0), name
