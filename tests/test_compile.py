"""``torch.compile`` of prepared (QAT) models.

* No graph break in QAT, CALIBRATION and VALIDATION (``torch._dynamo.explain``) on
  ResNet-18, MobileNetV2 and a small ViT; VALIDATION compiled with inductor equals eager
  bit for bit there.
* QAT training steps compiled with ``aot_eager`` (the same ops, functionalized) equal eager
  bit for bit; with inductor (the default backend, whose fused kernels round some float
  intermediates differently) the outputs stay within 30 dB SQNR of eager's.
* VALIDATION compiled equals eager and the converted model bit for bit.
* NaN / Inf in a compiled step is reported at the state change, as in eager.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import fxq
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig, default_qat_8bit_fake_quant_qconfig
from tests.helpers import ResidualNet, fake_quant_modules, sqnr


def _model(name: str):
    import torchvision

    if name == "vit":
        model = torchvision.models.VisionTransformer(
            image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
            num_classes=10,
        )  # fmt: skip
        return model, torch.randn(2, 3, 32, 32)
    return getattr(torchvision.models, name)(num_classes=10), torch.randn(2, 3, 64, 64)


@pytest.mark.parametrize("state", ["qat", "calibration", "validation"])
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "vit"])
def test_no_graph_break(name, state):
    fxq.set_march("bayes")
    torch.manual_seed(0)
    model, x = _model(name)
    qconfig = default_qat_8bit_fake_quant_qconfig
    if state == "calibration":
        qconfig = default_calib_8bit_fake_quant_qconfig
    prepared = fxq.prepare_qat_fx(model, {"": qconfig}).train()
    if state == "validation":  # scales first
        fxq.set_fake_quantize(prepared, "calibration")
        prepared(x)
        prepared.eval()
    fxq.set_fake_quantize(prepared, state)
    expected = prepared(x)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(prepared)(x)
    reasons = [b.reason.splitlines()[0] for b in explained.break_reasons]
    assert explained.graph_break_count == 0, reasons
    assert explained.graph_count == 1
    if state == "validation":  # each module's integer twin, one graph node each, eagerly
        ops = {str(n.target) for g in explained.graphs for n in g.graph.nodes}
        assert "fxq.validation_forward" in ops, ops
        torch._dynamo.reset()
        assert torch.equal(torch.compile(prepared)(x), expected)


def _prepared(net: type[torch.nn.Module] = ResidualNet):
    fxq.set_march("bayes")
    torch.manual_seed(0)
    model = fxq.prepare_qat_fx(net(), {"": default_qat_8bit_fake_quant_qconfig})
    fxq.set_fake_quantize(model, fxq.FakeQuantState.CALIBRATION)
    model(torch.randn(8, 3, 12, 12))
    fxq.set_fake_quantize(model, fxq.FakeQuantState.QAT)
    return model.train()


def _train_both(compiled, model, reference, steps: int = 3):
    """Yield the compiled and the eager outputs of ``steps`` identical SGD steps."""
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, reference)]
    labels = torch.arange(8) % 10
    for step in range(steps):
        x = torch.randn(8, 3, 12, 12, generator=torch.Generator().manual_seed(step))
        outputs = []
        for m, opt in zip((compiled, reference), optimizers):
            opt.zero_grad()
            y = m(x)
            F.cross_entropy(y, labels).backward()
            opt.step()
            outputs.append(y.detach())
        yield outputs


def test_compiled_qat_steps_with_aot_eager_equal_eager_bit_for_bit():
    """The compiled graph updates statistics, scales and BatchNorm buffers in place exactly
    as eager does (functionalization keeps every side effect)."""
    torch._dynamo.reset()
    model = _prepared()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for out, expected in _train_both(compiled, model, reference):
        assert torch.equal(out, expected)
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_compiled_qat_then_validation_with_inductor():
    """Inductor's kernels round a few float intermediates differently, so a fake quant here
    and there lands one step away (measured: 44-45 dB SQNR between compiled and eager outputs
    over four steps); VALIDATION, which runs the integer kernels, is exact."""
    torch._dynamo.reset()
    model = _prepared()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model)
    for out, expected in _train_both(compiled, model, reference):
        assert sqnr(expected, out) > 30.0
    fxq.set_fake_quantize(model, fxq.FakeQuantState.VALIDATION)
    model.eval()
    x = torch.randn(4, 3, 12, 12)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = compiled(x)
        assert torch.equal(got, model(x))
        assert torch.equal(got, fxq.convert_fx(model)(x))
        # new weights loaded after the state was set: the compiled model follows them (each
        # QAT module's integer twin is fetched outside the graph and rebuilt on a change)
        other = _prepared()
        other.load_state_dict(reference.state_dict())
        fxq.set_fake_quantize(other, fxq.FakeQuantState.VALIDATION)
        model.load_state_dict(other.state_dict())
        assert torch.equal(compiled(x), other.eval()(x))


def test_a_nan_in_a_compiled_qat_step_is_reported_at_the_state_change():
    torch._dynamo.reset()
    model = _prepared()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled(torch.randn(8, 3, 12, 12))
    fxq.set_fake_quantize(model, fxq.FakeQuantState.QAT)  # nothing bad yet
    x = torch.randn(8, 3, 12, 12)
    x[1, 2, 3, 4] = float("nan")
    compiled(x)  # no host sync in the compiled step: nothing raised here
    # a training loop's periodic check (outside the compiled function) names where the NaN
    # entered, the input's fake quant, before the layers it reached (the names of torch's
    # registration order put the input's last)
    first = next(n for n in model.graph.nodes if n.op == "call_module").target
    with pytest.raises(ValueError) as info:
        fxq.fake_quantize.check_non_finite(model)
    message = str(info.value)
    assert message.startswith(f"observer of the output of {first!r} saw NaN or Inf values")
    count = sum(isinstance(m, fxq.FakeQuantize) for m in model.modules())
    assert re.search(r"It is the first of (\d+) fake quants in the graph's order", message)
    assert 2 < int(re.search(r"first of (\d+)", message)[1]) <= count
    with pytest.raises(ValueError, match=r"observer of .* saw NaN or Inf"):
        fxq.set_fake_quantize(model, fxq.FakeQuantState.VALIDATION)


def _graphs_compiled_over_steps(model, steps: int = 2) -> int:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    for step in range(steps):
        x = torch.randn(8, 3, 12, 12, generator=torch.Generator().manual_seed(step))
        compiled(x).sum().backward()
    return counters["stats"]["unique_graphs"]


def test_a_calibrated_or_loaded_qat_model_compiles_once():
    """A QAT model whose scales were observed (calibrated eagerly, or loaded from such a
    model's state dict: the ``ptq`` -> QAT hand-off) compiles once for all its steps: the
    compiled step writes no ``observed`` flag, so nothing it was compiled for changes. A model
    that never observed learns it in its first step and recompiles once, at its second."""
    calibrated = _prepared()
    loaded = fxq.prepare_qat_fx(ResidualNet(), {"": default_qat_8bit_fake_quant_qconfig}).train()
    loaded.load_state_dict(calibrated.state_dict())
    fxq.set_fake_quantize(loaded, fxq.FakeQuantState.QAT)
    never = fxq.prepare_qat_fx(ResidualNet(), {"": default_qat_8bit_fake_quant_qconfig}).train()
    fxq.set_fake_quantize(never, fxq.FakeQuantState.QAT)
    unobserved = copy.deepcopy(never)
    unobserved.load_state_dict(never.state_dict())  # observed False: learnt in the first step
    assert not any(fq._observed_set for fq in fake_quant_modules(unobserved).values())
    assert _graphs_compiled_over_steps(calibrated) == 1
    assert _graphs_compiled_over_steps(loaded) == 1
    assert _graphs_compiled_over_steps(never) == 2
    assert all(bool(fq.observed) for fq in fake_quant_modules(loaded).values())


def _saved_for_backward_dtypes(model, x) -> list[torch.dtype]:
    """The dtypes of the tensors a compiled training step keeps for its backward pass, as the
    default partitioner (inductor's, ``min_cut_rematerialization_partition``) chooses them."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    kept: list[torch.dtype] = []

    def forward_compiler(gm, example_inputs):
        (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
        kept.extend(o.meta["val"].dtype for o in outputs if isinstance(o, torch.fx.Node))
        return gm

    backend = aot_autograd(
        fw_compiler=forward_compiler,
        bw_compiler=lambda gm, example_inputs: gm,
        partition_fn=min_cut_rematerialization_partition,
    )
    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(x).sum().backward()
    return kept


def test_a_compiled_qat_step_keeps_its_gradient_masks_as_bytes_not_bool():
    """Inductor's CPU code stores a ``bool`` one value at a time (22 ms for 3.2 million
    values against 1.4 ms as ``uint8``): the activations' STE masks and the fused ReLUs'
    masks are kept as ``uint8`` in a compiled graph (``fxq.utils.grad_mask``). Before, the
    partitioner kept a bool mask per fake quant and per fused ReLU."""
    model = _prepared()
    kept = _saved_for_backward_dtypes(model, torch.randn(8, 3, 12, 12))
    assert torch.bool not in kept, kept
    # the input's, conv1's, conv2's (with the residual's ReLU) and the head's output fake
    # quants' masks, and the stem's and conv1's fused ReLUs'
    assert kept.count(torch.uint8) >= 5, kept


def _written_in_place(node) -> bool:
    """Whether an FX node is an in-place op (``mul_``, ``torch.relu_``; not ``__add__``)."""
    if node.op not in ("call_method", "call_function"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.startswith("_")


def _functions_returning_in_place(fn, *args) -> list[str]:
    """Compile ``fn`` and return, for each ``autograd.Function`` forward dynamo captured
    (its ``fwd_body`` graphs), the in-place ops that wrote one of its results."""
    bodies = []

    def backend(gm, example_inputs):
        bodies.extend(m for n, m in gm.named_modules() if n.startswith("fwd_body"))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert bodies, "no autograd.Function was captured"
    found = []
    for body in bodies:
        (returned,) = [n.args[0] for n in body.graph.nodes if n.op == "output"]
        results = returned[0] if isinstance(returned[0], (tuple, list)) else [returned[0]]
        found += [str(n.target) for n in results if _written_in_place(n)]
    return found


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("clip", [False, True])
def test_compiled_fake_quants_return_results_not_written_in_place(exact, clip):
    """torch 2.11's dynamo gave an ``autograd.Function`` whose result an in-place op wrote
    a zero gradient: every gradient of a compiled QAT step was 0 and no parameter moved
    (ResNet-18 on an H200 with torch 2.11, and on the CPU; torch 2.13 and 2.14 are right).
    In a compiled graph fxq's straight-through estimators compute out of place."""
    from fxq.dtypes import qint8
    from fxq.fake_quantize import fake_quantize_ste
    from fxq.march.spec import Rounding

    scale = torch.tensor(0.02)

    def step(x):
        return fake_quantize_ste(x, scale, qint8, Rounding.HALF_UP, exact=exact, clip_gradient=clip)

    assert _functions_returning_in_place(step, torch.randn(64, requires_grad=True)) == []


class _StandaloneBatchNorm(torch.nn.Module):
    """A BatchNorm after a ReLU: not folded into the convolution, fxq.qat's own BatchNorm
    (its factor, with a gradient, is fake-quantized as a weight)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(self.bn(torch.relu(self.conv(x))).mean((2, 3)))


def _prepared_standalone_batchnorm():
    model = _prepared(_StandaloneBatchNorm)
    assert type(model.bn).__module__ == "fxq.qat.batchnorm"
    return model


@pytest.mark.parametrize("prepare", [_prepared, _prepared_standalone_batchnorm])
@pytest.mark.parametrize("backend", ["inductor", "aot_eager_decomp_partition"])
def test_a_compiled_qat_step_gives_eager_gradients(backend, prepare):
    """Inductor's partitioner may recompute in the backward pass what the forward computed
    from a buffer that the step then updates in place (torch 2.14, pytorch/pytorch#197039):
    the BN fold's factors, from ``running_var``, were recomputed after the BatchNorm's update
    and the stem's BatchNorm weight got a gradient 3.4 % off eager's under inductor (with
    inductor's decompositions and partitioner but no code generation, a version-counter
    error). Every gradient of a compiled step equals eager's but for float rounding
    (measured: 4e-5 relative under inductor). fxq.qat's own BatchNorm computes its factor
    from ``running_var`` too."""
    torch._dynamo.reset()
    model = prepare()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(8, 3, 12, 12, generator=torch.Generator().manual_seed(0))
    for m in (compiled, reference):
        F.cross_entropy(m(x), torch.arange(8) % 10).backward()
    got = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        error = (got[name].grad - p.grad).norm() / p.grad.norm()
        assert error < 1e-3, (name, float(error))


def test_a_compiled_qat_step_returns_no_result_written_in_place_and_moves_every_weight():
    """The whole QAT step (fake quants, fused ReLUs): see the test above."""
    model = _prepared()
    x = torch.randn(8, 3, 12, 12)
    assert _functions_returning_in_place(model, x) == []
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    F.cross_entropy(compiled(x), torch.arange(8) % 10).backward()
    opt.step()
    still = [k for k, p in model.named_parameters() if torch.equal(p, before[k])]
    assert still == []
