import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxq
from fxq import qat
from fxq.fx.tracer import FxqTraceError, call_wrapped_method
from tests.helpers import TinyRetinaNet, calibrate, run_in_fresh_process

q8 = fxq.qconfig.default_qat_8bit_fake_quant_qconfig


@fxq.fx_wrap()
def clip_if_large(x):
    # data-dependent Python: cannot be traced, runs at call time
    if x.abs().max() > 1.0:
        return x.clamp(-1.0, 1.0)
    return x


class UsesFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        return clip_if_large(self.conv(x))


def test_wrapped_function_is_one_node_and_runs_at_call_time():
    model = UsesFunction()
    gm = fxq.symbolic_trace(model)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [clip_if_large]
    small, large = torch.full((1, 3, 2, 2), 0.01), torch.full((1, 3, 2, 2), 50.0)
    for x in (small, large):
        assert torch.equal(gm(x), model(x))


@fxq.fx_wrap()
class Opaque(nn.Module):
    """A leaf class: its forward has data-dependent Python and a conv inside."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        for _ in range(int(x.shape[0])):
            x = self.conv(x)
        return x


def test_wrapped_class_is_a_leaf_and_its_children_are_swapped(bayes):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.opaque = Opaque()

        def forward(self, x):
            return self.opaque(x) * 2

    gm = fxq.symbolic_trace(M())
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["opaque"]
    prepared = fxq.prepare_qat_fx(M(), {"": q8})
    assert type(prepared.opaque) is Opaque
    assert type(prepared.opaque.conv) is qat.Conv2d and prepared.opaque.conv.standalone
    calibrate(prepared, [torch.randn(2, 3, 4, 4)])
    assert bool(prepared.opaque.conv.input_quant[0].observed)


def test_wrapped_method_training_branch_runs_at_call_time():
    model = TinyRetinaNet()
    gm = fxq.symbolic_trace(model)
    wrapped = [n for n in gm.graph.nodes if n.target is call_wrapped_method]
    assert len(wrapped) == 1 and wrapped[0].args[1] == "postprocess"
    x = torch.randn(2, 3, 32, 32)
    gm.train()
    assert set(gm(x)) == {"cls", "box"}
    gm.eval()
    out = gm(x)
    model.eval()
    ref = model(x)
    assert set(out) == {"scores", "boxes", "count"} and out["count"] == ref["count"]
    assert torch.equal(out["boxes"], ref["boxes"])


def test_modules_used_inside_wrapped_method_are_swapped(bayes):
    prepared = fxq.prepare_qat_fx(TinyRetinaNet(), {"": q8})
    box_scale = prepared.box_scale  # only the wrapped post-process calls it
    assert type(box_scale) is qat.Linear and box_scale.standalone
    x = torch.randn(2, 3, 32, 32)
    calibrate(prepared, [x])
    assert bool(box_scale.activation_post_process.observed)
    # shared heads: one QAT module per call site, same weight, own output fake quant
    first, second = prepared.cls_head.conv, prepared.cls_head_conv_call1
    assert first.weight is second.weight and first.weight_fake_quant is second.weight_fake_quant
    assert first.activation_post_process is not second.activation_post_process
    assert first.activation_post_process.scale.item() != second.activation_post_process.scale.item()
    prepared.train()
    fxq.set_fake_quantize(prepared, "qat")
    out = prepared(x)
    sum(t.sum() for t in out["cls"] + out["box"]).backward()
    assert first.weight.grad is not None and first.weight.grad.abs().sum() > 0


def test_dict_inputs_and_outputs(bayes):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(3, 4, 1)
            self.b = nn.Conv2d(3, 4, 1)

        def forward(self, batch):
            return {
                "sum": self.a(batch["rgb"]) + self.b(batch["depth"]),
                "rgb": self.a(batch["rgb"]),
            }

    model = M()
    batch = {"rgb": torch.randn(2, 3, 4, 4), "depth": torch.randn(2, 3, 4, 4)}
    gm = fxq.symbolic_trace(model)
    ref = model(batch)
    out = gm(batch)
    assert set(out) == {"sum", "rgb"} and torch.equal(out["sum"], ref["sum"])
    prepared = fxq.prepare_qat_fx(model, {"": q8})
    calibrate(prepared, [batch])
    fxq.set_fake_quantize(prepared, "validation")
    out = prepared(batch)
    assert (out["sum"] - ref["sum"]).abs().max() < 0.1
    # each tensor taken from the input dict got a quantize stub
    assert {"getitem_quant", "getitem_1_quant", "getitem_2_quant"} <= {
        n for n, _ in prepared.named_children()
    }


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        y = self.conv(x)
        if y.mean() > 0:  # data-dependent control flow
            y = F.relu(y)
        return y


class HoldsBranchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = Branchy()

    def forward(self, x):
        return self.body(x)


def test_control_flow_error_names_line_and_advice():
    with pytest.raises(FxqTraceError) as info:
        fxq.symbolic_trace(HoldsBranchy())
    message = str(info.value)
    line = Branchy.forward.__code__.co_firstlineno + 2
    assert f"test_tracer.py:{line}, in Branchy.forward (module 'body', Branchy)" in message
    assert "if y.mean() > 0:" in message
    assert "@fxq.fx_wrap()" in message


def test_prepare_failure_leaves_model_untouched(bayes):
    model = HoldsBranchy()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(FxqTraceError):
        fxq.prepare_qat_fx(model, {"": q8})
    assert type(model.body.conv) is nn.Conv2d
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fx_wrap_rejects_non_callables():
    with pytest.raises(TypeError, match="applies to functions, methods and nn.Module classes"):
        fxq.fx_wrap()(3)
    with pytest.raises(TypeError, match="nn.Module subclass"):
        fxq.fx_wrap()(int)


def test_save_and_load_in_a_fresh_process(bayes, tmp_path):
    prepared = fxq.prepare_qat_fx(TinyRetinaNet(), {"": q8})
    x = torch.randn(2, 3, 32, 32)
    calibrate(prepared, [x])
    fxq.set_fake_quantize(prepared, "validation")
    with torch.no_grad():
        expected = prepared(x)
    torch.save({"model": prepared, "x": x, "expected": expected}, tmp_path / "m.pt")
    code = f"""
        import torch
        blob = torch.load({str(tmp_path / "m.pt")!r}, weights_only=False)
        with torch.no_grad():
            out = blob["model"](blob["x"])
        assert torch.equal(out["scores"], blob["expected"]["scores"])
        assert torch.equal(out["boxes"], blob["expected"]["boxes"])
        blob["model"].train()
        assert set(blob["model"](blob["x"])) == {{"cls", "box"}}
        print("ok")
        """
    assert run_in_fresh_process(code) == "ok"
