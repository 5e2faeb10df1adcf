"""``convert_fx``: QAT model -> integer model.

Every fxq.qat module is replaced by its integer twin (``fxq.quantized``,
the op registry, ``fxq.registry``), built from its current weights and
scales; fake quants disappear into them. Values between quantized ops are
``fxq.QTensor``s. Value-preserving ops (reshapes, ReLU, max pooling, ...)
run on QTensors unchanged. Where a quantized value reaches float code (a
float region, an ``@fx_wrap()`` function, a ``DeQuantStub``, the model's
outputs) a ``DeQuantize`` is inserted.

The QAT model in VALIDATION state runs the same integer twins, so both agree
bit for bit.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from fxq import stubs
from fxq.fake_quantize import FakeQuantize, check_non_finite
from fxq.fx.graph_utils import set_submodule, unique_name
from fxq.fx.load_guard import guard_loads
from fxq.qat.base import QATModule
from fxq.qat.stubs import QuantStub
from fxq.quantized.base import QuantizedModule
from fxq.quantized.mapping import to_quantized
from fxq.quantized.stubs import DeQuantize, UnusedQuantize
from fxq.registry import Kind, row_for
from fxq.utils.warning_summary import summarises_warnings, warn_per_module

__all__ = ["convert_fx"]

_DEQUANT_STUBS = (stubs.DeQuantStub,)


@summarises_warnings("fxq.convert_fx")
def convert_fx(model: GraphModule, dequantize_outputs: bool = True) -> GraphModule:
    """Lower a QAT model to the integer model.

    Args:
        model: a model returned by ``prepare_qat_fx``, calibrated or trained
            (not modified).
        dequantize_outputs: return float outputs (True) or the QTensors of
            quantized outputs (False).

    Returns:
        a GraphModule in eval mode, on the QAT model's device; an ordinary module
        that ``state_dict`` / ``torch.save`` handle.

    Raises:
        TypeError: when ``model`` is not a prepared fxq model, or its parameters are
            shards (``torch.distributed.fsdp.fully_shard``).
        RuntimeError: when a fake quant never observed data (calibrate first).
    """
    if not isinstance(model, GraphModule) or not any(
        isinstance(m, QATModule) for m in model.modules()
    ):
        raise TypeError("convert_fx expects the model returned by fxq.prepare_qat_fx")
    sharded = _sharded_parameters(model)
    if sharded:
        raise TypeError(
            f"convert_fx: the model's parameters are shards ({sharded[0]} is a DTensor; "
            "torch.distributed.fsdp.fully_shard). Gather a full state dict on every rank "
            "(torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
            "options=StateDictOptions(full_state_dict=True))), load it into a freshly prepared "
            "model and convert that"
        )
    _require_observed(model)
    gm = copy.deepcopy(model)
    gm.eval()
    _Converter(gm, dequantize_outputs).run()
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    if len(devices) == 1:  # what the integer modules computed on the host follows the model
        gm.to(devices.pop())
    return guard_loads(gm)  # a failed load_state_dict leaves it as it was


def _sharded_parameters(model: nn.Module) -> list[str]:
    """Names of ``model``'s parameters that are ``DTensor`` shards (FSDP2, tensor parallel)."""
    if not torch.distributed.is_available():
        return []
    from torch.distributed.tensor import DTensor

    return [n for n, p in model.named_parameters() if isinstance(p, DTensor)]


def _never_observed(fq: FakeQuantize) -> bool:
    return not fq.is_high_precision and not fq.is_fixed_scale and not bool(fq.observed)


def _require_observed(model: nn.Module) -> None:
    # a standalone module that never ran (opaque code skipped it, or nothing calls it) stays
    # float in the converted model (see _convert_standalone); every other scale must exist
    skipped: set[int] = set()
    check_non_finite(model)  # naming where NaN / Inf entered
    for m in model.modules():
        if isinstance(m, FakeQuantize):
            m.finalize()
        if isinstance(m, QATModule) and m.standalone or isinstance(m, QuantStub):
            # standalone modules that never ran stay float; stubs that saw no tensor pass values on
            skipped.update(id(fq) for fq in m.modules() if isinstance(fq, FakeQuantize))
    missing = [
        name
        for name, m in model.named_modules()
        if isinstance(m, FakeQuantize) and id(m) not in skipped and _never_observed(m)
    ]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise RuntimeError(
            f"convert_fx: {len(missing)} fake quant(s) never observed data, so they have no scale: "
            f"{shown}. Calibrate (FakeQuantState.CALIBRATION) or train before converting"
        )


class _Converter:
    def __init__(self, gm: GraphModule, dequantize_outputs: bool) -> None:
        self.gm = gm
        self.dequantize_outputs = dequantize_outputs
        self.modules = dict(gm.named_modules())
        self.quantized: dict[Node, bool] = {}
        self.dequant_nodes: dict[tuple[Node, bool], Node] = {}

    def run(self) -> None:
        graph = self.gm.graph
        for node in list(graph.nodes):
            self.quantized[node] = False
            if node.op == "output":
                if self.dequantize_outputs:
                    self._dequantize_inputs(node, for_float_layer=False)
                continue
            if node.op in ("placeholder", "get_attr"):
                continue
            module = self.modules.get(node.target) if node.op == "call_module" else None
            if isinstance(module, QuantStub) and _never_observed(module.activation_post_process):
                set_submodule(self.gm, node.target, UnusedQuantize(node.target))
                continue
            if isinstance(module, QATModule):
                integer = to_quantized(module)
                integer.name = node.target
                integer.qconfig_source = module.qconfig_source
                set_submodule(self.gm, node.target, integer)
                self.modules[node.target] = integer
                self.quantized[node] = not getattr(integer, "high_precision", False)
                continue
            if isinstance(module, _DEQUANT_STUBS) or _is_ao_dequant_stub(module):
                dq = DeQuantize()
                set_submodule(self.gm, node.target, dq)
                self.modules[node.target] = dq
                continue
            rule, _ = row_for(node, self.modules)
            first = next(iter(node.all_input_nodes), None)
            if (
                rule.kind is Kind.PASSTHROUGH
                and first is not None
                and self.quantized.get(first, False)
            ):
                self.quantized[node] = True  # runs on the QTensor unchanged
            elif rule.kind is not Kind.NONTENSOR:
                self._dequantize_inputs(node)
        self._convert_standalone()
        graph.lint()
        self.gm.recompile()

    def _dequantize_inputs(self, node: Node, for_float_layer: bool = True) -> None:
        """Insert a ``DeQuantize`` before every quantized input of ``node``.

        Before float layers it follows the model's dtype (``.half()`` runs the
        float region in half); before the model's outputs it gives the exact
        float32 value.
        """

        def swap(arg: Node) -> Node:
            if not self.quantized.get(arg, False):
                return arg
            key = (arg, for_float_layer)
            dq = self.dequant_nodes.get(key)
            if dq is None:
                path = unique_name(self.gm, "", f"{arg.name}_dequant")
                self.gm.add_module(path, DeQuantize(follow_model_dtype=for_float_layer))
                with self.gm.graph.inserting_after(arg):
                    dq = self.gm.graph.call_module(path, (arg,))
                self.dequant_nodes[key] = dq
            return dq

        node.args = map_arg(node.args, swap)
        node.kwargs = map_arg(node.kwargs, swap)

    def _convert_standalone(self) -> None:
        for parent_name, parent in list(self.gm.named_modules()):
            if isinstance(parent, QuantizedModule):
                continue
            for name, child in list(parent.named_children()):
                if isinstance(child, QATModule) and child.standalone:
                    path = f"{parent_name}.{name}" if parent_name else name
                    if any(
                        _never_observed(fq)
                        for fq in child.modules()
                        if isinstance(fq, FakeQuantize)
                    ):
                        warn_per_module(
                            repr(path),
                            f"fxq.convert_fx: {path!r} ({type(child).__name__}) is reached only from "
                            "opaque code and never ran during calibration; it stays float",
                            headline="reached only from opaque code and never ran during "
                            "calibration; they stay float",
                            what="layer",
                            stacklevel=3,
                        )
                        setattr(parent, name, child.to_float())
                        continue
                    integer = to_quantized(child)
                    integer.name = path
                    setattr(parent, name, integer)


def _is_ao_dequant_stub(module: nn.Module | None) -> bool:
    if module is None:
        return False
    from torch.ao.quantization import DeQuantStub

    return isinstance(module, DeQuantStub)
