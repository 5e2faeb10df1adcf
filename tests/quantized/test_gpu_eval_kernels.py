"""The integer model's GPU path: Triton requantization, convolution as one GEMM, memos.

* The Triton requantization kernels (``fxq.quantized._requant_triton``), run by Triton's
  interpreter on the CPU, equal fxq's torch definitions bit for bit: per tensor and per channel,
  with and without a fused residual, half-up and half-even with planted ties, every
  output dtype (and on CUDA when a GPU is present).
* ``conv_as_gemm`` equals torch's convolution bit for bit on exact integers: 1, 2 and
  3 spatial dims, strides, dilations, asymmetric padding, groups, a batch split; so does
  its Triton im2col (``fxq.quantized._im2col_triton``), interpreted on the CPU and on CUDA,
  on inputs that are not contiguous too.
* ``memo_by_identity`` recomputes when a remembered tensor changes in place, and does not
  remember tensors without a version counter.
* On CUDA the integer model of a CNN equals the CPU's and makes no host sync.
"""

from __future__ import annotations

import itertools
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import fxq
from fxq.dtypes import as_qdtype
from fxq.march import Rounding
from fxq.quantized import functional as qf
from fxq.quantized import native
from tests.helpers import run_in_fresh_process

_QINT8 = as_qdtype("qint8")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def compare_requantize(device: str) -> int:
    """The Triton kernels on ``device`` against fxq's torch definitions; the number compared."""
    torch.manual_seed(0)
    compared = 0
    multiplier = torch.randint(1, 2**15, (5,), dtype=torch.int64)
    shift = torch.randint(9, 24, (5,), dtype=torch.int64)
    multiplier[0], shift[0] = 1, 9  # with the ties below: exact halves
    layouts = {  # name: (multiplier, shift, channel axis)
        "per channel": (multiplier, shift, 1),
        "per tensor": (multiplier[:1], shift[:1], None),
        "one channel factor": (multiplier[:1], shift[:1], 1),
    }
    for (acc_dtype, out_dtype), half_even in itertools.product(native._FUNCS, (False, True)):
        rounding = Rounding.HALF_EVEN if half_even else Rounding.HALF_UP
        qdtype = as_qdtype("qint16" if out_dtype is torch.int16 else "qint8")
        acc = torch.randint(-(2**20), 2**20, (3, 5, 7, 11)).to(acc_dtype)
        acc.view(-1)[:200] = (torch.arange(200) * 2**9 + 2**8).to(acc_dtype)
        for name, (m, n, axis) in layouts.items():
            expected = qf.requantize_exact(
                acc, m, n, qdtype, rounding, axis, use_native=False,
                as_float=out_dtype is torch.float32,
            )  # fmt: skip
            r = torch.ldexp(m.double(), -n.double())
            got = native.triton_requantize(
                acc.to(device), r, axis, qdtype.qmin, qdtype.qmax, half_even, out_dtype
            )
            assert torch.equal(got.cpu(), expected), (acc_dtype, out_dtype, name, half_even)
            compared += 1
        residual = torch.randint(-128, 128, acc.shape).float()
        for (m, n, _), (rm, rn, _) in itertools.product(
            (layouts["per channel"], layouts["per tensor"]), repeat=2
        ):
            rn = rn - 12  # the residual's factor: 2**12 larger
            expected = qf.requantize_residual(
                acc, residual, rm, rn, m, n, _QINT8, rounding, 1, use_native=False
            )
            got = native.triton_requantize_add(
                acc.to(device), residual.to(device),
                torch.ldexp(rm.double(), -rn.double()), torch.ldexp(m.double(), -n.double()),
                1, -128, 127, half_even,
            )  # fmt: skip
            assert torch.equal(got.cpu(), expected), (acc_dtype, m.numel(), rm.numel())
            compared += 1
    return compared


#: per accumulator / output dtype pair and rounding: 3 factor layouts, and 4 factor pairs
#: with a residual (every accumulator dtype has a residual kernel)
_COMPARED = 2 * (3 + 4) * len(native._FUNCS)

_INTERPRETED = """
from tests.quantized.test_gpu_eval_kernels import compare_requantize
print(compare_requantize("cpu"))
"""


def test_the_triton_requantization_equals_fxq_arithmetic_interpreted():
    pytest.importorskip("triton")
    assert int(run_in_fresh_process(_INTERPRETED, TRITON_INTERPRET="1")) == _COMPARED


@needs_cuda
def test_the_triton_requantization_equals_fxq_arithmetic_on_cuda():
    assert compare_requantize("cuda") == _COMPARED


_CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize(
    "stride, dilation, pads, groups",
    [(1, 1, (0, 0), 1), (2, 1, (1, 1), 1), (1, 2, (2, 2), 2), (2, 1, (1, 0), 4), (3, 2, (0, 2), 1)],
)
@pytest.mark.parametrize("block", [1 << 28, 500])
def test_conv_as_gemm_equals_torch_on_integers(
    dims, stride, dilation, pads, groups, block, monkeypatch
):
    monkeypatch.setattr(qf, "_GEMM_BLOCK_ELEMENTS", block)  # 500: one image per block
    torch.manual_seed(dims)
    kernel = (3, 2, 1)[:dims] if dims == 3 else (3,) * dims
    x = torch.randint(-128, 128, (5, 8) + (9,) * dims).float()
    w = torch.randint(-128, 128, (12, 8 // groups) + kernel).float()
    b = torch.randint(-1000, 1000, (12,)).float()
    padded = F.pad(x, [p for _ in range(dims) for p in pads])
    expected = _CONVS[dims](padded, w, b, stride, 0, dilation, groups)
    got = qf.conv_as_gemm(x, w, b, (stride,) * dims, [pads] * dims, (dilation,) * dims, groups)
    assert torch.equal(got, expected)


@needs_cuda
@pytest.mark.parametrize("groups", [1, 2])
def test_conv_as_gemm_on_cuda_equals_torch_on_the_cpu(groups):
    """On CUDA (TF32 GEMMs under ``accumulate``'s plan) as torch's convolution on the CPU."""
    torch.manual_seed(0)
    x = torch.randint(-128, 128, (64, 32, 28, 28)).float()
    w = torch.randint(-128, 128, (64, 32 // groups, 3, 3)).float()
    expected = F.conv2d(x, w, None, 1, 1, 1, groups)
    plan = qf.plan_accumulation(8, int(w.abs().sum((1, 2, 3)).max()))
    with qf._tensor_core_gemms(plan):
        got = qf.conv_as_gemm(x.cuda(), w.cuda(), None, (1, 1), [[1, 1]] * 2, (1, 1), groups)
    assert torch.equal(got.cpu(), expected)


def compare_im2col_convolutions(device: str) -> int:
    """``conv_as_gemm`` with the Triton im2col on ``device`` (CUDA, or the CPU interpreted)
    against torch's convolution on the CPU, bit for bit: 1-d and 2-d, strides, dilations,
    asymmetric padding, groups, inputs that are not contiguous, float64, a batch split.
    Returns how many were compared."""
    torch.manual_seed(0)
    compared = 0
    cases = [  # dims, channels, size, kernel, stride, dilation, pads, groups
        (2, 4, 7, 3, 1, 1, (1, 1), 1),
        (2, 4, 9, 3, 2, 1, (1, 0), 2),
        (2, 3, 8, 2, 3, 2, (0, 2), 3),
        (2, 2, 11, 5, 2, 1, (2, 2), 1),
        (2, 6, 7, 1, 2, 1, (0, 0), 1),
        (1, 4, 13, 3, 1, 2, (2, 1), 2),
        (2, 4, 7, 1, 1, 1, (0, 0), 1),  # 1x1 at stride 1: the columns are a view, not copied
    ]
    for dims, c, size, k, stride, dilation, pads, groups in cases:
        x = torch.randint(-128, 128, (2, c) + (size,) * dims).float()
        w = torch.randint(-128, 128, (12, c // groups) + (k,) * dims).float()
        b = torch.randint(-1000, 1000, (12,)).float()
        padded = F.pad(x, [p for _ in range(dims) for p in pads])
        expected = _CONVS[dims](padded, w, b, stride, 0, dilation, groups)
        inputs = {"contiguous": x}
        if dims == 2:
            inputs["channels_last"] = x.contiguous(memory_format=torch.channels_last)
            inputs["a slice"] = torch.cat([x, x], 3)[..., :size]
        for name, given in inputs.items():
            for dtype, block in ((torch.float32, 1 << 28), (torch.float64, 100)):
                qf._GEMM_BLOCK_ELEMENTS = block  # 100: one image per block
                try:
                    got = qf.conv_as_gemm(
                        given.to(device, dtype), w.to(device, dtype), b.to(device, dtype),
                        (stride,) * dims, [pads] * dims, (dilation,) * dims, groups,
                    )  # fmt: skip
                finally:
                    qf._GEMM_BLOCK_ELEMENTS = 1 << 28
                assert got.dtype is dtype
                assert torch.equal(got.cpu().float(), expected), (dims, k, stride, name, dtype)
                compared += 1
    return compared


#: 6 2-d cases with 3 inputs each and one 1-d case, each in 2 dtypes
_IM2COL_COMPARED = 2 * (6 * 3 + 1)

_IM2COL_INTERPRETED = """
from unittest import mock
from fxq.quantized import _im2col_triton, functional
from tests.quantized.test_gpu_eval_kernels import compare_im2col_convolutions
# several tiles per image, partial ones in both directions
_im2col_triton._TILE, _im2col_triton._TILE_POSITIONS = 128, 16
for method in _im2col_triton.METHODS:
    functional.IM2COL_METHOD = method
    with mock.patch.object(_im2col_triton, "im2col", wraps=_im2col_triton.im2col) as im2col:
        compared = compare_im2col_convolutions("cpu")
    methods = {call.kwargs["method"] for call in im2col.call_args_list}
    print(compared, im2col.call_count, *methods)
"""


def test_the_triton_im2col_kernels_equal_torch_convolution_interpreted():
    pytest.importorskip("triton")
    lines = run_in_fresh_process(_IM2COL_INTERPRETED, TRITON_INTERPRET="1").splitlines()
    assert [line.split()[2:] for line in lines] == [["rows"], ["tiles"]]
    for line in lines:
        compared, calls = map(int, line.split()[:2])
        assert compared == _IM2COL_COMPARED
        # each kernel made the columns of all but the 1x1 case (3 inputs, 2 dtypes): once
        # per float32 case, once per image (2) in float64
        assert calls == (_IM2COL_COMPARED - 6) // 2 * (1 + 2)


@needs_cuda
@pytest.mark.parametrize("method", ["rows", "tiles", "strided", None])
def test_the_im2col_ways_equal_torch_convolution_on_cuda(monkeypatch, method):
    monkeypatch.setattr(qf, "IM2COL_METHOD", method)
    monkeypatch.setattr(qf, "_IM2COL_CHOICES", {})
    timed = mock.Mock(wraps=qf._device_seconds)
    monkeypatch.setattr(qf, "_device_seconds", timed)
    assert compare_im2col_convolutions("cuda") == _IM2COL_COMPARED
    if method is None:  # each geometry with a copy timed once per way, then remembered
        assert_timed_once_per_geometry(timed)
    else:
        assert timed.call_count == 0


def assert_timed_once_per_geometry(timed: mock.Mock) -> None:
    """After ``compare_im2col_convolutions`` in the timed mode: three ways timed per geometry
    remembered, none again in a second pass."""
    choices = dict(qf._IM2COL_CHOICES)
    assert choices and set(choices.values()) <= {"rows", "tiles", "strided"}
    assert timed.call_count == 3 * len(choices)
    compare_im2col_convolutions(next(iter(choices))[0].type)
    assert timed.call_count == 3 * len(choices) and choices == qf._IM2COL_CHOICES


def _ways(calls: list[str]):
    return {
        name: (lambda name=name, i=i: calls.append(name) or torch.full((2,), float(i)))
        for i, name in enumerate(["strided", "rows", "tiles"])
    }


def test_the_fastest_im2col_is_timed_once_per_geometry_and_kept(monkeypatch):
    seconds = {"strided": 3.0, "rows": 1.0, "tiles": 2.0}
    timed = []

    def device_seconds(fn, device, calls):
        fn()
        timed.append(timed_name := fn()[0].item())
        return seconds[["strided", "rows", "tiles"][int(timed_name)]]

    monkeypatch.setattr(qf, "_device_seconds", device_seconds)
    monkeypatch.setattr(qf, "_IM2COL_CHOICES", {})
    calls: list[str] = []
    key = (torch.device("cpu"), "geometry")
    qf._fastest_im2col(key, _ways(calls))
    assert {key: "rows"} == qf._IM2COL_CHOICES
    assert len(timed) == 3  # each way timed once
    calls.clear()
    assert torch.equal(qf._fastest_im2col(key, _ways(calls)), torch.full((2,), 1.0))
    assert calls == ["rows"] and len(timed) == 3  # remembered: not timed again
    other = (torch.device("cpu"), "another geometry")
    seconds["tiles"] = 0.5
    qf._fastest_im2col(other, _ways(calls))
    assert qf._IM2COL_CHOICES[other] == "tiles"


def test_no_im2col_is_timed_while_a_cuda_graph_is_captured(monkeypatch):
    monkeypatch.setattr(qf, "_IM2COL_CHOICES", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(qf, "_device_seconds", mock.Mock(side_effect=AssertionError("timed")))
    calls: list[str] = []
    qf._fastest_im2col((torch.device("cuda", 0), "geometry"), _ways(calls))
    assert calls == ["strided"] and qf._IM2COL_CHOICES == {}


@pytest.mark.parametrize(
    "kernel, stride, out, kernels",
    [
        ((3, 3), (1, 1), (56, 56), True),
        ((1, 1), (2, 2), (28, 28), True),  # strided 1x1: the columns are a copy
        ((1, 1), (1, 1), (56, 56), False),  # a view of the input: no copy to make
        ((3,), (1,), (4096,), True),
        ((3,), (1,), (65535 * 1024 + 1,), False),  # more programs than the row grid holds
        ((3, 3), (1, 1), (2, 4097), False),  # an output row longer than a tile
    ],
)
def test_the_triton_im2col_offers_its_kernels_where_they_run(
    monkeypatch, kernel, stride, out, kernels
):
    pytest.importorskip("triton")
    monkeypatch.setattr(native, "triton_runs_on", lambda x: True)
    x = torch.zeros(1, 1, 1, 1)
    assert (qf._triton_im2col(x, len(kernel), kernel, stride, out) is not None) is kernels


def test_memo_by_identity_sees_in_place_changes():
    calls = []

    def build():
        calls.append(1)
        return float(t.sum())

    t = torch.ones(3)
    assert qf.memo_by_identity("test", (t,), build) == 3.0
    assert qf.memo_by_identity("test", (t,), build) == 3.0
    assert len(calls) == 1
    t.mul_(2)  # a new version: built again
    assert qf.memo_by_identity("test", (t,), build) == 6.0
    assert len(calls) == 2
    with torch.inference_mode():
        u = torch.ones(2)
    for _ in range(2):  # no version counter: never remembered
        qf.memo_by_identity("test", (u,), lambda: calls.append(1))
    assert len(calls) == 4


def _integer_cnn(device: str):
    from tests.helpers import ResidualNet

    fxq.set_march("bayes")
    torch.manual_seed(0)
    qat = fxq.prepare_qat_fx(ResidualNet(), {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig})
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            qat(torch.randn(8, 3, 12, 12))
    return fxq.convert_fx(qat.eval()).to(device)


@needs_cuda
def test_the_integer_model_on_cuda_equals_the_cpu_and_makes_no_host_sync():
    model = _integer_cnn("cuda")
    x = torch.randn(8, 3, 12, 12)
    with torch.no_grad():
        expected = model.cpu()(x)
        model.cuda()
        x = x.cuda()
        model(x)  # the first call fills the memos
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = model(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.cpu(), expected)


def test_graphed_refuses_inputs_off_cuda():
    from fxq.utils.cuda_graph import graphed

    with pytest.raises(ValueError, match="example inputs must be CUDA tensors"):
        graphed(torch.nn.Linear(2, 2), torch.randn(1, 2))


@needs_cuda
def test_a_graphed_integer_model_equals_eager_and_refuses_a_changed_model():
    from fxq.utils.cuda_graph import graphed

    model = _integer_cnn("cuda")
    x = torch.randn(8, 3, 12, 12, device="cuda")
    fast = graphed(model, x)
    with torch.no_grad():
        for seed in range(2):
            y = torch.randn(8, 3, 12, 12, generator=torch.Generator().manual_seed(seed))
            assert torch.equal(fast(y.cuda()), model(y.cuda()))
        smaller = torch.randn(3, 3, 12, 12, device="cuda")  # another shape: eager
        assert torch.equal(fast(smaller), model(smaller))
        next(model.buffers()).add_(0)  # an in-place change: a new version
        with pytest.raises(RuntimeError, match="changed after its CUDA graph was captured"):
            fast(x)
