"""Real models on CUDA: the whole pipeline on the GPU, bit for bit equal to the CPU.

A user prepares on the CPU, calls ``.cuda()``, calibrates, trains and converts
on the GPU, and deploys the integer model anywhere. For CNNs and transformers
(torchvision, timm, fxq's op zoo) this checks that the QAT model in VALIDATION
on CUDA, the integer model on CUDA and the same integer model moved to the CPU
give identical outputs; that calibration on CUDA sets the scales the CPU would
(the statistics are float reductions, so equal to the last few ULPs); that QAT
steps train on CUDA; that ``ptq`` runs on CUDA to the CPU's accuracy; and that
an integer model converted on CUDA exports to ONNX that onnxruntime runs bit for
bit. Skipped without CUDA (``tests/test_devices.py`` has the small-model checks).
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig as q8
from tests.helpers import recalibrate_bn, sqnr

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICE = torch.device("cuda")


def _torchvision(name: str) -> nn.Module:
    import torchvision

    return getattr(torchvision.models, name)(num_classes=10)


def _zoo() -> nn.Module:
    from tests.zoo import Zoo

    return Zoo()


def _family(name: str):
    def build() -> nn.Module:
        from tests.models.test_model_families import CASES

        return CASES[name].build()

    return build


# name: (builder, input shape); transformers come from the model-family suite
MODELS = {
    "zoo": (_zoo, (4, 3, 16, 16)),
    "resnet18": (lambda: _torchvision("resnet18"), (4, 3, 64, 64)),
    "mobilenet_v2": (lambda: _torchvision("mobilenet_v2"), (4, 3, 64, 64)),
    "mobilenet_v3_large": (lambda: _torchvision("mobilenet_v3_large"), (4, 3, 64, 64)),
    "efficientnet_b0": (lambda: _torchvision("efficientnet_b0"), (4, 3, 64, 64)),
    "vit": (_family("vit (torchvision VisionTransformer)"), (2, 3, 32, 32)),
    "swin_t": (_family("swin_t"), (2, 3, 32, 32)),
    "deit_tiny": (_family("deit_tiny_patch16_224"), (2, 3, 32, 32)),
    "mobilevit_xxs": (_family("mobilevit_xxs"), (2, 3, 64, 64)),
    "levit_128s": (_family("levit_128s"), (2, 3, 64, 64)),
}


def _first(out) -> torch.Tensor:
    return out if torch.is_tensor(out) else out[0]


def _outputs(out) -> list[torch.Tensor]:
    return [out] if torch.is_tensor(out) else list(out)


def _prepared(name: str) -> tuple[nn.Module, list[torch.Tensor]]:
    """The float model prepared on the CPU, and three input batches (two to calibrate)."""
    build, shape = MODELS[name]
    torch.manual_seed(0)
    model = build()
    batches = [torch.randn(shape) for _ in range(3)]
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        recalibrate_bn(model, batches[:2])  # random init: give BatchNorm real statistics
    model.eval()
    fxq.set_march("bayes")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = fxq.prepare_qat_fx(model, {"": q8}, example_inputs=(batches[0],))
    return prepared, batches


def _calibrate(model: nn.Module, batches: list[torch.Tensor]) -> nn.Module:
    fxq.set_fake_quantize(model, fxq.FakeQuantState.CALIBRATION)
    model.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random init: vanishing scales are clamped
        for x in batches:
            model(x)
    return model


@contextlib.contextmanager
def _tf32(enabled: bool):
    """CUDA convolutions and matmuls in TF32 (what CUDA users train with) or in full
    float32 (as on the CPU)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _scales(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: m.scale.detach().cpu()
        for name, m in model.named_modules()
        if isinstance(m, fxq.FakeQuantize)
    }


@pytest.mark.parametrize("name", list(MODELS))
def test_pipeline_on_cuda_equals_the_cpu_bit_for_bit(name):
    prepared, batches = _prepared(name)
    on_cpu = _calibrate(copy.deepcopy(prepared), batches[:2])
    with _tf32(False):
        on_cuda = copy.deepcopy(prepared).to(DEVICE)
        _calibrate(on_cuda, [b.to(DEVICE) for b in batches[:2]])
    devices = {t.device.type for t in [*on_cuda.parameters(), *on_cuda.buffers()]}
    assert devices == {DEVICE.type}

    # calibration on the GPU sets the CPU's scales (the float model's convolutions and
    # reductions run in another order: equal to float32 rounding)
    cpu_scales, cuda_scales = _scales(on_cpu), _scales(on_cuda)
    assert cpu_scales.keys() == cuda_scales.keys() and cpu_scales
    for key, value in cpu_scales.items():
        torch.testing.assert_close(cuda_scales[key], value, rtol=1e-4, atol=0, msg=key)

    # with the same scales, VALIDATION on CUDA, the integer model on CUDA and on the CPU agree
    on_cuda.load_state_dict({k: v.to(DEVICE) for k, v in on_cpu.state_dict().items()})
    x = batches[2]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fxq.set_fake_quantize(on_cuda, fxq.FakeQuantState.VALIDATION)
        validation = _outputs(on_cuda(x.to(DEVICE)))
        integer = fxq.convert_fx(on_cuda)
        assert {t.device.type for t in integer.buffers()} == {DEVICE.type}
        on_gpu = _outputs(integer(x.to(DEVICE)))
        on_host = _outputs(copy.deepcopy(integer).cpu()(x))
        fxq.set_fake_quantize(on_cpu, fxq.FakeQuantState.VALIDATION)
        cpu_validation = _outputs(on_cpu(x))
    assert validation[0].device.type == DEVICE.type and on_gpu[0].device.type == DEVICE.type
    for v, g, h, c in zip(validation, on_gpu, on_host, cpu_validation):
        assert torch.isfinite(h).all()
        assert torch.equal(v.cpu(), g.cpu())
        assert torch.equal(g.cpu(), h)
        assert torch.equal(h, c)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "deit_tiny"])
def test_qat_steps_on_cuda_move_weights_and_stay_exact(name):
    prepared, batches = _prepared(name)
    model = _calibrate(prepared.to(DEVICE), [b.to(DEVICE) for b in batches[:2]])
    x = batches[2].to(DEVICE)
    labels = torch.arange(x.shape[0], device=x.device) % 10
    fxq.set_fake_quantize(model, fxq.FakeQuantState.QAT)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(_first(model(x)).float()[:, :10], labels)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses)))
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) > len(before) // 2, f"only {len(moved)} of {len(before)} parameters moved"
    fxq.set_fake_quantize(model, fxq.FakeQuantState.VALIDATION)
    model.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        validation = _first(model(x))
        integer = _first(fxq.convert_fx(model).cpu()(x.cpu()))
    assert torch.equal(validation.cpu(), integer)


# ptq's default; the 10 % int16 recipe's steps (learned rounding with float activations,
# then bias tuning against the float outputs)
PTQ_OPTIONS = {
    "default": {},
    "float_activations+tune_biases": {
        "method": "best",
        "float_activations": True,
        "iters": 30,
        "tune_biases": True,
    },
}


@pytest.mark.parametrize("options", list(PTQ_OPTIONS))
def test_ptq_on_cuda_matches_the_cpu_accuracy(options):
    """``ptq`` (ranges, offsets, equalization, learned rounding, bias tuning) on the GPU:
    ImageNet MobileNetV2 on real photos reaches the CPU's accuracy (the GPU's float
    convolutions round differently, so the learned rounding differs a little)."""
    from fxq.calibration import ptq
    from fxq.qconfig import default_calib_8bit_fake_quant_qconfig
    from fxq.utils.sample_data import photo_crops, pretrained_mobilenet_v2

    model = pretrained_mobilenet_v2()
    calib = list(photo_crops(16, size=96, seed=0).split(8))
    held = photo_crops(16, size=96, seed=1)
    with torch.no_grad():
        reference = model(held)
    fxq.set_march("bayes")
    prepared = fxq.prepare_qat_fx(model, {"": default_calib_8bit_fake_quant_qconfig})
    results = {}
    for device in ("cpu", DEVICE.type):
        on_device = copy.deepcopy(prepared).to(device)
        torch.manual_seed(0)
        ptq(on_device, [b.to(device) for b in calib], show_progress=False, **PTQ_OPTIONS[options])
        integer = fxq.convert_fx(on_device)
        assert {t.device.type for t in integer.buffers()} == {device}
        with torch.no_grad():
            results[device] = sqnr(reference, integer(held.to(device)).cpu())
    assert results["cpu"] > 14.5, results
    assert abs(results[DEVICE.type] - results["cpu"]) < 0.5, results


def test_an_integer_model_converted_on_cuda_exports_bit_exact():
    from fxq.export import to_onnx
    from tests.export.helpers import assert_equal_outputs, outputs, run_onnx

    prepared, batches = _prepared("mobilenet_v2")
    model = _calibrate(prepared.to(DEVICE), [b.to(DEVICE) for b in batches[:2]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        integer = fxq.convert_fx(model)
        x = (batches[2].to(DEVICE),)
        onnx_model = to_onnx(integer, x)
    on_host = copy.deepcopy(integer).cpu()
    assert_equal_outputs(outputs(on_host, (batches[2],)), run_onnx(onnx_model, (batches[2],)))
    with torch.no_grad():
        assert torch.equal(integer(*x).cpu(), on_host(batches[2]))


class _Channelwise(nn.Module):
    """Ops whose integer parameters are per channel: PReLU(C), a transposed conv with a bias."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.prelu = nn.PReLU(8, init=0.1)
        self.up = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.head(self.up(self.prelu(self.conv(x))))


def test_per_channel_ops_on_cuda_equal_the_cpu_with_tf32_on():
    """TF32 is what CUDA users train with; the integer arithmetic must not depend on it."""
    torch.manual_seed(0)
    model = _Channelwise()
    with torch.no_grad():
        model.prelu.weight.copy_(torch.linspace(-0.5, 0.5, 8))
        model.up.bias.mul_(50)  # int32 biases well beyond TF32's 11 significant bits
    fxq.set_march("bayes")
    batches = [torch.randn(4, 3, 16, 16) for _ in range(3)]
    prepared = _calibrate(fxq.prepare_qat_fx(model, {"": q8}), batches[:2])
    fxq.set_fake_quantize(prepared, fxq.FakeQuantState.VALIDATION)
    x = batches[2]
    with _tf32(True), torch.no_grad():
        expected = fxq.convert_fx(prepared)(x)
        on_device = copy.deepcopy(prepared).to(DEVICE)
        validation = on_device(x.to(DEVICE))
        integer = fxq.convert_fx(on_device)(x.to(DEVICE))
    assert torch.equal(validation.cpu(), expected)
    assert torch.equal(integer.cpu(), expected)


def test_yuv_input_on_cuda_equals_the_cpu():
    from fxq.deploy import yuv_input
    from fxq.functional import rgb2centered_yuv
    from tests.test_deploy import _converted_yuv_net

    _, _, converted = _converted_yuv_net()
    yuv_input(converted, "quant", swing="full")
    yuv = rgb2centered_yuv(torch.randint(0, 256, (4, 3, 8, 8)).float(), "full")
    with torch.no_grad():
        expected = converted(yuv)
        got = copy.deepcopy(converted).to(DEVICE)(yuv.to(DEVICE))
    assert got.device.type == DEVICE.type
    assert torch.equal(got.cpu(), expected)


def test_qat_steps_on_cuda_make_no_host_sync():
    """A host sync stalls the GPU until its queue drains (one per fake quant made fxq's step
    1.6x torch.ao's on an H200): CUDA's sync debug mode turns any into an error."""
    prepared, batches = _prepared("mobilenet_v2")
    model = _calibrate(prepared.to(DEVICE), [b.to(DEVICE) for b in batches[:2]])
    x = batches[2].to(DEVICE)
    labels = torch.arange(x.shape[0], device=DEVICE) % 10
    fxq.set_fake_quantize(model, fxq.FakeQuantState.QAT)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), labels).backward()
        opt.step()

    step()  # the first step creates the optimizer's state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_value_in_a_cuda_qat_step_is_reported(bad):
    """On CUDA the NaN / Inf check is deferred (no host sync per step) but not dropped: a bad
    value in one QAT step is reported when the state changes."""
    prepared, batches = _prepared("resnet18")
    model = _calibrate(prepared.to(DEVICE), [b.to(DEVICE) for b in batches[:2]])
    fxq.set_fake_quantize(model, fxq.FakeQuantState.QAT)
    model.train()
    x = batches[2].clone()
    x[0, 0, 0, 0] = bad
    model(x.to(DEVICE))
    with pytest.raises(ValueError, match=r"observer of .* saw NaN or Inf"):
        fxq.set_fake_quantize(model, fxq.FakeQuantState.VALIDATION)


def test_a_compiled_qat_step_in_cuda_graphs_equals_the_default_compile():
    """``torch.compile(qat, mode="reduce-overhead")`` replays the compiled step as CUDA graphs
    (no launch cost on the host): nothing is skipped, and its outputs and its updates of the
    statistics, scales, BatchNorm buffers and weights equal the default mode's bit for bit
    (the same kernels). How compiled steps compare with eager ones: ``tests/test_compile.py``
    (inductor rounds some float intermediates differently, and in a randomly initialised
    ResNet-18 training on 4 images the few values that land one step away in the first
    layers change its outputs by -24 dB, compiled module by module or whole, on the CPU)."""
    from torch._dynamo.utils import counters

    prepared, batches = _prepared("resnet18")
    model = _calibrate(prepared.to(DEVICE), [b.to(DEVICE) for b in batches[:2]])
    fxq.set_fake_quantize(model, fxq.FakeQuantState.QAT)
    model.train()
    copies = {mode: copy.deepcopy(model) for mode in ("default", "reduce-overhead")}
    torch._dynamo.reset()
    counters.clear()
    outputs = {}
    for mode, copied in copies.items():
        run = torch.compile(copied, mode=None if mode == "default" else mode)
        opt = torch.optim.SGD(copied.parameters(), lr=1e-3, momentum=0.9)
        outputs[mode] = []
        for step in range(3):
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            opt.zero_grad()
            out = run(batches[step].to(DEVICE))
            F.cross_entropy(out, torch.arange(4, device=DEVICE)).backward()
            opt.step()
            outputs[mode].append(out.detach().clone())
    assert counters["inductor"]["cudagraph_skips"] == 0
    for got, expected in zip(outputs["reduce-overhead"], outputs["default"]):
        assert torch.equal(got, expected)
    graphs, default = copies["reduce-overhead"].state_dict(), copies["default"].state_dict()
    assert all(torch.equal(graphs[k], v) for k, v in default.items() if torch.is_tensor(v))
    initial = dict(model.named_parameters())
    moved = [
        k for k, p in copies["reduce-overhead"].named_parameters() if not torch.equal(p, initial[k])
    ]
    assert len(moved) == len(initial)
