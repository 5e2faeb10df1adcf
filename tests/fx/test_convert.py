import contextlib
import io
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import fxq
from fxq import quantized
from fxq.debug import compare_qat_quantized, float_fake_quant
from fxq.qconfig import (
    default_calib_8bit_fake_quant_qconfig as q8,
)
from fxq.qconfig import (
    default_calib_8bit_weight_16bit_act_fake_quant_qconfig as q16,
)
from fxq.qconfig import (
    default_calib_out_8bit_fake_quant_qconfig as qout,
)
from fxq.quantized import native
from fxq.quantized.base import Standalone
from fxq.quantized.stubs import DeQuantize, Quantize
from tests.helpers import (
    ResidualNet,
    TinyRetinaNet,
    calibrate,
    recalibrate_bn,
    run_in_fresh_process,
    sqnr,
)
from tests.zoo import Zoo

ROOT = Path(__file__).resolve().parents[2]


def _calibrated(model, qconfig_dict, data):
    return calibrate(fxq.prepare_qat_fx(model, qconfig_dict), data)


def _validation(prepared, x):
    fxq.set_fake_quantize(prepared, "validation")
    with torch.no_grad():
        return prepared(x)


def test_convert_lowers_every_qat_module_and_leaves_input_alone(bayes):
    prepared = _calibrated(ResidualNet(), {"": q8}, [torch.randn(4, 3, 8, 8)])
    before = [type(m) for m in prepared.modules()]
    converted = fxq.convert_fx(prepared)
    assert [type(m) for m in prepared.modules()] == before
    kinds = {
        n: type(converted.get_submodule(n.target))
        for n in converted.graph.nodes
        if n.op == "call_module"
    }
    assert {k.name: v for k, v in kinds.items()} == {
        "x_quant": Quantize,
        "stem": quantized.weighted.Conv2d,
        "conv1": quantized.weighted.Conv2d,
        "conv2": quantized.weighted.Conv2d,
        "pool": quantized.pooling.AdaptiveAvgPool,
        "fc": quantized.weighted.Linear,
        "fc_dequant": DeQuantize,
    }
    assert not any(isinstance(m, fxq.FakeQuantize) for m in converted.modules())
    assert not converted.training


def test_values_between_ops_are_qtensors(bayes):
    prepared = _calibrated(ResidualNet(), {"": q8}, [torch.randn(4, 3, 8, 8)])
    converted = fxq.convert_fx(prepared)
    seen = []
    converted.conv2.register_forward_hook(lambda m, i, o: seen.append((i, o)))
    out = converted(torch.randn(2, 3, 8, 8))
    (inputs, output) = seen[0]
    assert all(isinstance(t, fxq.QTensor) for t in inputs) and isinstance(output, fxq.QTensor)
    assert output.int_repr().dtype is torch.int8 and output.int_repr().min() >= 0  # fused ReLU
    assert isinstance(out, torch.Tensor) and out.dtype is torch.float32


@pytest.mark.parametrize(
    "march, qconfig, min_sqnr",
    [("bayes", q8, 14.0), ("bayes", q16, 25.0), ("bernoulli2", q8, 14.0), ("bayes-e", q8, 14.0)],
    ids=["bayes-int8", "bayes-int16", "bernoulli2", "bayes-e"],
)
def test_every_op_is_bit_exact_with_validation(march, qconfig, min_sqnr):
    fxq.set_march(march)
    model = Zoo()
    data = [torch.randn(4, 3, 16, 16) for _ in range(3)]
    recalibrate_bn(model, data)
    prepared = _calibrated(model, {"": qconfig}, data)
    x = torch.randn(4, 3, 16, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        expected = _validation(prepared, x)
        converted = fxq.convert_fx(prepared)
        with torch.no_grad():
            got = converted(x)
            ref = model(x)
    for e, g in zip(expected, got):
        assert torch.equal(e, g)
    assert sqnr(ref[0], got[0]) > min_sqnr
    saturated = [w for w in caught if "saturated" in str(w.message)]
    if qconfig is q16:  # two int16 activations multiplied over 256 elements overflow int32
        assert saturated and "MatMul 'matmul'" in str(saturated[0].message)
    else:
        assert not saturated
        assert sqnr(ref[1], got[1]) > min_sqnr


def test_native_kernels_and_torch_path_agree_on_a_whole_model(bayes):
    assert native.available()
    model = Zoo()
    data = [torch.randn(4, 3, 16, 16) for _ in range(2)]
    recalibrate_bn(model, data)
    converted = fxq.convert_fx(_calibrated(model, {"": q8}, data))
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        fast = converted(x)
        saved = native._LIB
        native._LIB = None
        try:
            slow = converted(x)
        finally:
            native._LIB = saved
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))


def test_detector_with_wrapped_postprocess(bayes):
    model = TinyRetinaNet()
    data = [torch.randn(2, 3, 32, 32) for _ in range(2)]
    prepared = _calibrated(model, {"": q8}, data)
    x = torch.randn(2, 3, 32, 32)
    expected = _validation(prepared, x)
    converted = fxq.convert_fx(prepared)
    assert isinstance(converted.box_scale, Standalone)  # used only inside the wrapped method
    assert isinstance(converted.cls_head_conv_call1, quantized.weighted.Conv2d)
    with torch.no_grad():
        got = converted(x)
    assert got["count"] == expected["count"]
    assert torch.equal(got["scores"], expected["scores"]) and torch.equal(
        got["boxes"], expected["boxes"]
    )


def test_float_regions_and_borders(bayes):
    model = ResidualNet()
    data = [torch.randn(4, 3, 8, 8)]
    prepared = _calibrated(model, {"": q8, "module_name": {"conv1": None}}, data)
    x = torch.randn(4, 3, 8, 8)
    expected = _validation(prepared, x)
    converted = fxq.convert_fx(prepared)
    assert type(converted.conv1).__name__ == "Fused"  # float conv+bn+relu
    inputs = [
        a.target
        for a in converted.graph.find_nodes(op="call_module", target="conv1")[0].all_input_nodes
    ]
    assert inputs == ["stem_dequant"]
    with torch.no_grad():
        assert torch.equal(converted(x), expected)


def test_high_precision_output(bayes):
    model = ResidualNet()
    data = [torch.randn(4, 3, 8, 8)]
    prepared = _calibrated(model, {"": q8, "module_name": {"fc": qout}}, data)
    x = torch.randn(4, 3, 8, 8)
    expected = _validation(prepared, x)
    converted = fxq.convert_fx(prepared)
    fc = converted.fc
    assert fc.high_precision
    seen = []
    fc.register_forward_hook(lambda m, i, o: seen.append((i[0], o)))
    with torch.no_grad():
        got = converted(x)
    assert torch.equal(got, expected)
    # the output is the int32 accumulator times s_x * s_w: no int8 rounding
    q_in, out = seen[0]
    acc = q_in.int_repr().double() @ fc.weight.double().T + fc.bias.double()
    assert torch.equal(out, (acc * fc.accumulator_scale).float())
    steps = out / fc.accumulator_scale.float()
    assert (steps - steps.round()).abs().max() < 1e-2 and steps.abs().max() > 1000


def test_state_dict_round_trip(bayes):
    data = [torch.randn(4, 3, 8, 8)]
    a = fxq.convert_fx(_calibrated(ResidualNet(), {"": q8}, data))
    b = fxq.convert_fx(_calibrated(ResidualNet(), {"": q8}, [d * 3 for d in data]))
    x = torch.randn(2, 3, 8, 8)
    assert not torch.equal(a(x), b(x))
    b.load_state_dict(a.state_dict())
    assert torch.equal(a(x), b(x))
    assert all(
        v.dtype in (torch.int8, torch.int32, torch.int64, torch.float32, torch.float64)
        for v in a.state_dict().values()
    )


def test_save_and_load_converted_model_in_a_fresh_process(bayes, tmp_path):
    converted = fxq.convert_fx(_calibrated(TinyRetinaNet(), {"": q8}, [torch.randn(2, 3, 32, 32)]))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = converted(x)
    torch.save({"model": converted, "x": x, "expected": expected}, tmp_path / "m.pt")
    code = f"""
        import torch
        blob = torch.load({str(tmp_path / "m.pt")!r}, weights_only=False)
        with torch.no_grad():
            out = blob["model"](blob["x"])
        assert torch.equal(out["scores"], blob["expected"]["scores"])
        assert torch.equal(out["boxes"], blob["expected"]["boxes"])
        print(type(blob["model"].stem if hasattr(blob["model"], "stem") else blob["model"].lat1).__name__)
        """
    assert run_in_fresh_process(code) == "Conv2d"


def test_print_tabular_has_readable_names(bayes):
    converted = fxq.convert_fx(_calibrated(ResidualNet(), {"": q8}, [torch.randn(4, 3, 8, 8)]))
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        converted.graph.print_tabular()
    table = buffer.getvalue()
    names = [line.split()[1] for line in table.splitlines()[2:] if line.strip()]
    assert names == [
        "x",
        "x_quant",
        "stem",
        "conv1",
        "conv2",
        "pool",
        "flatten",
        "fc",
        "fc_dequant",
        "output",
    ]


def test_convert_needs_calibration_and_a_prepared_model(bayes):
    prepared = fxq.prepare_qat_fx(ResidualNet(), {"": q8})
    with pytest.raises(
        RuntimeError, match=r"9 fake quant\(s\) never observed data.*stem\.activation_post_process"
    ):
        fxq.convert_fx(prepared)
    with pytest.raises(TypeError, match="expects the model returned by fxq.prepare_qat_fx"):
        fxq.convert_fx(fxq.symbolic_trace(ResidualNet()))


def test_a_graph_edit_that_changes_scales_is_reported(bayes):
    converted = fxq.convert_fx(_calibrated(ResidualNet(), {"": q8}, [torch.randn(4, 3, 8, 8)]))
    converted.x_quant.scale.mul_(2)
    with pytest.warns(RuntimeWarning, match=r"Conv2d 'stem' was converted for input 0 scale"):
        converted(torch.randn(1, 3, 8, 8))


class _FloatMiddle(nn.Module):
    """A quantized conv, a float region (qconfig None), a quantized conv."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.mid = nn.Conv2d(4, 4, 1)
        self.b = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.b(self.mid(self.a(x)))


def test_float_region_follows_the_model_dtype(bayes):
    qconfig = {"": q8, "module_name": {"mid": None}}
    converted = fxq.convert_fx(_calibrated(_FloatMiddle(), qconfig, [torch.randn(4, 3, 8, 8)]))
    x = torch.randn(2, 3, 8, 8)
    expected = converted(x)
    assert expected.dtype is torch.float32
    converted.double()  # the float conv runs in float64 on the dequantized values
    got = converted(x)
    assert got.dtype is torch.float32  # the model's output: the exact value of the integers
    assert (got - expected).abs().max() <= converted.b.output_scale.item()
    converted.float()
    assert torch.equal(converted(x), expected)


def test_several_outputs_of_one_op_are_dequantized(bayes):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, x):
            return torch.nn.functional.max_pool2d(self.conv(x), 2, return_indices=True)

    prepared = _calibrated(M(), {"": q8}, [torch.randn(4, 3, 8, 8)])
    converted = fxq.convert_fx(prepared)
    x = torch.randn(2, 3, 8, 8)
    values, indices = converted(x)
    ref_values, ref_indices = _validation(prepared, x)
    assert isinstance(values, torch.Tensor) and torch.equal(values, ref_values)
    assert torch.equal(indices, ref_indices)


def test_compare_qat_quantized(bayes, capsys):
    model = ResidualNet()
    data = [torch.randn(8, 3, 8, 8) for _ in range(2)]
    prepared = _calibrated(model, {"": q8}, data)
    converted = fxq.convert_fx(prepared)
    x = torch.randn(8, 3, 8, 8)
    rows = compare_qat_quantized(prepared, converted, x)
    assert [r["layer"] for r in rows] == ["x_quant", "stem", "conv1", "conv2", "pool", "fc"]
    assert all(r["exact"] == 1.0 and r["max_lsb"] == 0 for r in rows)
    assert "exact match" in capsys.readouterr().out
    assert prepared.x_quant.state is fxq.FakeQuantState.CALIBRATION  # state restored
    with float_fake_quant(prepared):
        rows = compare_qat_quantized(prepared, converted, x, show=False)
    stem = rows[1]
    assert stem["exact"] > 0.99 and stem["max_lsb"] <= 1  # float fake quant vs integer, first conv
