import copy
import operator

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


# -- torch.fx.wrap functions, item assignment, positional example inputs ------------------------
def _pad_and_attend(x, window: int):
    # torchvision-style helper: shape questions plain torch.fx cannot answer
    pad = (window - x.shape[1] % window) % window
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    scores = torch.matmul(x, x.transpose(-2, -1))
    return torch.matmul(scores.softmax(-1), x)


def _scale_if_positive(x):
    if x.sum() > 0:  # control flow on tensor data: stays one node
        return x * 2
    return x


torch.fx.wrap("_pad_and_attend")
torch.fx.wrap("_scale_if_positive")


class UsesTorchFxWrap(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return _scale_if_positive(_pad_and_attend(self.proj(x), 4))


def _call_targets(gm):
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


def test_torch_fx_wrap_functions_are_traced_into_when_they_can_be(bayes):
    model = UsesTorchFxWrap().eval()
    x = torch.randn(2, 6, 8)
    gm = fxq.symbolic_trace(model, example_inputs=(x,))
    targets = _call_targets(gm)
    # the padding helper is traced into; the data-dependent one stays one node, and the failed
    # attempt at tracing into it leaves nothing behind
    assert _pad_and_attend not in targets and targets.count(torch.matmul) == 2
    assert targets.count(_scale_if_positive) == 1 and targets.count(operator.mul) == 0
    # only the real leaf call is marked as torch.fx's wrapped call (code generation registers
    # the targets of marked nodes with torch.fx.wrap, which would break the next trace)
    marked = [n.target for n in gm.graph.nodes if n.meta.get("is_wrapped")]
    assert marked == [_scale_if_positive]
    for batch in (x, -x.abs(), torch.randn(3, 6, 8)):
        assert torch.equal(gm(batch), model(batch))
    # without example inputs the shape question cannot be answered: one node, as in torch.fx
    plain = fxq.symbolic_trace(model)
    assert _call_targets(plain) == [_pad_and_attend, _scale_if_positive]
    assert torch.equal(plain(x), model(x))


def test_ops_inside_torch_fx_wrap_functions_are_quantized(bayes):
    model = UsesTorchFxWrap().eval()
    x = torch.randn(2, 6, 8)
    qat_model = fxq.prepare_qat_fx(model, {"": q8}, example_inputs=(x,), float_ops="ignore")
    kinds = {type(m) for m in qat_model.modules()}
    assert qat.MatMul in kinds and qat.Softmax in kinds
    calibrate(qat_model, [x, torch.randn(2, 6, 8)])
    fxq.set_fake_quantize(qat_model, "validation")
    with torch.no_grad():
        assert torch.equal(fxq.convert_fx(qat_model)(x), qat_model(x))


class FillsAMask(nn.Module):
    """``mask[a:b, c:d] = k`` on a tensor built from the input's shape (torchvision swin)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        y = self.conv(x)
        mask = y.new_zeros((y.shape[-2], y.shape[-1]))
        mask[:2, :] = 1.0
        mask[:, -1:] = -1.0
        return y + mask


def test_item_assignment_is_recorded_and_its_readers_see_the_write(bayes):
    from fxq.fx.example_values import setitem_

    model = FillsAMask().eval()
    x = torch.randn(1, 3, 4, 5)
    gm = fxq.symbolic_trace(model, example_inputs=(x,))
    assert _call_targets(gm).count(setitem_) == 2
    for batch in (x, torch.randn(2, 3, 6, 3)):
        assert torch.equal(gm(batch), model(batch))
    # the mask depends on the input's shape only: a constant, not a float op on activations
    qat_model = fxq.prepare_qat_fx(model, {"": q8}, example_inputs=(x,), float_ops="error")
    calibrate(qat_model, [x, torch.randn(1, 3, 4, 5)])
    with torch.no_grad():
        assert torch.allclose(qat_model(x), model(x), atol=1e-6)  # CALIBRATION is the float model
        fxq.set_fake_quantize(qat_model, "validation")
        assert torch.equal(fxq.convert_fx(qat_model)(x), qat_model(x))


def test_item_assignment_into_an_activation_is_a_listed_float_op(bayes):
    class ZeroesAChannel(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)

        def forward(self, x):
            y = self.conv(x)
            y[:, 0] = 0.0
            return torch.relu(y)

    model = ZeroesAChannel().eval()
    x = torch.randn(1, 3, 4, 4)
    with pytest.warns(fxq.fx.prepare.FloatOpWarning, match=r"setitem_ \(fxq\.fx\.example_values"):
        qat_model = fxq.prepare_qat_fx(model, {"": q8}, example_inputs=(x,))
    calibrate(qat_model, [x])
    with torch.no_grad():  # the write is not lost: relu reads the written tensor
        assert torch.allclose(qat_model(x), model(x), atol=1e-6)
        assert bool((qat_model(x)[:, 0] == 0).all())


class OptionalMask(nn.Module):
    """timm's ``forward(x, attn_mask=None, is_causal=False)``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, attn_mask=None, is_causal=False):
        y = self.proj(x)
        if attn_mask is not None or is_causal:
            y = y + attn_mask
        return y


def test_positional_example_inputs_trace_the_later_arguments_at_their_defaults(bayes):
    model = OptionalMask().eval()
    x = torch.randn(2, 4, 8)
    gm = fxq.symbolic_trace(model, example_inputs=(x,))
    assert operator.add not in _call_targets(gm)
    assert torch.equal(gm(x), model(x))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [(n.target, n.args, bool(n.meta.get("fxq_concrete"))) for n in placeholders] == [
        ("x", (), False),
        ("attn_mask", (None,), True),
        ("is_causal", (False,), True),
    ]
    # given positionally, the mask is a graph input
    masked = fxq.symbolic_trace(model, example_inputs=(x, torch.zeros(2, 4, 8)))
    assert operator.add in _call_targets(masked)
    # prepare: nothing left in float, integer equals VALIDATION
    qat_model = fxq.prepare_qat_fx(model, {"": q8}, example_inputs=(x,), float_ops="error")
    calibrate(qat_model, [x])
    fxq.set_fake_quantize(qat_model, "validation")
    with torch.no_grad():
        assert torch.equal(fxq.convert_fx(qat_model)(x), qat_model(x))


def test_torch_transformer_layers_are_traced_through_and_integer(bayes):
    # torch.fx keeps every torch.nn module a leaf; nn.TransformerEncoderLayer is made of linear
    # layers, attention and norms, and reads its weights for a fast-path check (get_attr nodes
    # nobody uses, which must not survive the fusion that swaps those linear layers)
    layer = nn.TransformerEncoderLayer(32, 2, 64, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 5, 32)
    gm = fxq.symbolic_trace(model, example_inputs=(x,))
    leaves = {type(gm.get_submodule(n.target)) for n in gm.graph.nodes if n.op == "call_module"}
    assert nn.TransformerEncoderLayer not in leaves and nn.Linear in leaves
    assert not [n for n in gm.graph.nodes if n.op == "get_attr" and not n.users]
    assert torch.equal(gm(x), model(x))
    qat_model = fxq.prepare_qat_fx(model, {"": q8}, example_inputs=(x,), float_ops="error")
    calibrate(qat_model, [x, torch.randn(2, 5, 32)])
    with torch.no_grad():
        assert torch.allclose(qat_model(x), model(x), atol=1e-5)
        fxq.set_fake_quantize(qat_model, "validation")
        assert torch.equal(fxq.convert_fx(qat_model)(x), qat_model(x))
    # without example inputs its mask checks cannot be answered: one (float) node, as before
    plain = fxq.symbolic_trace(nn.Sequential(layer).eval())
    assert [
        type(plain.get_submodule(n.target)) for n in plain.graph.nodes if n.op == "call_module"
    ] == [nn.TransformerEncoderLayer]


class ResizesUnlessSquare16(nn.Module):
    """A branch on sizes (timm MobileViT's ``if new_h != H or new_w != W``): traced with an
    example, the graph holds the branch the example took."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        if x.shape[-1] != 16 or x.shape[-2] != 16:
            x = F.interpolate(x, size=(16, 16), mode="nearest")
        return self.conv(x)


def test_a_branch_decided_from_the_example_sizes_is_checked_at_each_call(bayes, tmp_path):
    model = ResizesUnlessSquare16().eval()
    x = torch.randn(1, 3, 16, 16)
    qat_model = fxq.prepare_qat_fx(model, {"": q8}, example_inputs=(x,))
    calibrate(qat_model, [x])
    fxq.set_fake_quantize(qat_model, "validation")
    integer = fxq.convert_fx(qat_model)
    torch.save(integer, tmp_path / "integer.pt")
    unpickled = torch.load(tmp_path / "integer.pt", weights_only=False)  # traced again
    line = f"{__file__}:{ResizesUnlessSquare16.forward.__code__.co_firstlineno + 1}"
    for gm in (qat_model, integer, unpickled):
        with torch.no_grad():
            assert gm(torch.randn(2, 3, 16, 16)).shape == (2, 4, 16, 16)  # the same answer
            # the float model resizes a 20 x 20 input; the traced graph would not have
            with pytest.raises(
                RuntimeError,
                match=rf"{line}: this condition on tensor sizes was False for the example inputs "
                r"the model was traced with, and is True for these inputs",
            ):
                gm(torch.randn(1, 3, 20, 20))
    # traced with a 20 x 20 example, the resizing branch is the graph
    gm = fxq.symbolic_trace(model, example_inputs=(torch.randn(1, 3, 20, 20),))
    y = torch.randn(1, 3, 24, 24)
    with torch.no_grad():
        assert torch.equal(gm(y), model(y))
    with pytest.raises(RuntimeError, match="was True for the example inputs"):
        gm(x)


class ScalesLongSequences(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):  # (batch, sequence, 8)
        if x.shape[1] > 1:  # true for every call below
            x = x * 0.5
        return self.fc(x)


def test_the_check_of_a_decided_branch_compiles_with_dynamic_sizes(bayes):
    """Under torch.compile with dynamic sizes the condition is a SymBool: the check guards on
    it (an identity test against True raised for valid calls)."""
    x = torch.randn(2, 6, 8)
    qat_model = fxq.prepare_qat_fx(ScalesLongSequences().eval(), {"": q8}, example_inputs=(x,))
    calibrate(qat_model, [x])
    fxq.set_fake_quantize(qat_model, "validation")
    with torch.no_grad():
        qat_model(x)  # the observed check runs once, outside a graph
    torch._dynamo.reset()
    compiled = torch.compile(qat_model, backend="eager", dynamic=True, fullgraph=True)
    with torch.no_grad():
        for length in (6, 7, 9):
            y = torch.randn(2, length, 8)
            assert torch.equal(compiled(y), qat_model(y))
        with pytest.raises(RuntimeError, match="was True for the example inputs"):
            qat_model(torch.randn(2, 1, 8))
