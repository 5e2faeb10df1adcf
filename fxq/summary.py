"""Readable summaries of prepared and converted models.

``fxq.summary(model)`` prints one row per graph node: what it is, the dtype and
scale of its inputs and output, where its qconfig came from, and whether the
march runs it; ops that fell back to float stand out in the ``unsupported``
column. ``show=False`` returns the rows as a list of dicts for scripts.
"""

from __future__ import annotations

from typing import Any

from tabulate import tabulate
from torch import nn
from torch.fx import GraphModule, Node

from fxq.fake_quantize import FakeQuantize
from fxq.fx.graph_utils import tensor_inputs
from fxq.fx.tracer import call_wrapped_method, is_opaque_call
from fxq.qat.base import QATModule
from fxq.quantized.base import QuantizedModule, Standalone
from fxq.quantized.stubs import DeQuantize, Quantize
from fxq.registry import Kind, row_for

__all__ = ["summary"]

_COLUMNS = ("node", "op", "type", "inputs", "output", "qconfig", "march", "unsupported")


def _quant(dtype: Any, scale: Any) -> str:
    name = getattr(dtype, "name", str(dtype))
    if scale is None or scale.numel() != 1:
        return name
    return f"{name} @ {scale.item():.6g}"


def _fake_quant(fq: FakeQuantize) -> str:
    if fq.is_high_precision:
        return "int32 accumulator"
    return (
        _quant(fq.dtype, fq.scale if bool(fq.observed) or fq.is_fixed_scale else None)
        + ("" if bool(fq.observed) or fq.is_fixed_scale else " (not calibrated)")
        + (f" (on chip, fused with {fq.on_chip_with})" if fq.on_chip_with else "")
    )


def _type_name(node: Node, module: nn.Module | None) -> str:
    if module is not None:
        name = type(module).__name__
        fused = getattr(module, "fused_description", None)
        return fused() if callable(fused) else name
    if node.target is call_wrapped_method:
        return f"fx_wrap method {node.args[1]}"
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def summary(model: nn.Module, show: bool = True) -> list[dict[str, Any]]:
    """Describe every node of a prepared (QAT) or converted model.

    Args:
        model: the GraphModule from ``prepare_qat_fx`` or ``convert_fx``.
        show: print the table (tabulate).

    Returns:
        one dict per node with keys ``node``, ``op``, ``type``, ``inputs``,
        ``output``, ``qconfig``, ``march`` and ``unsupported``.

    Raises:
        TypeError: when ``model`` is not a GraphModule.
    """
    if not isinstance(model, GraphModule):
        raise TypeError(
            f"fxq.summary expects a GraphModule from prepare_qat_fx / convert_fx, got {type(model).__name__}"
        )
    modules = dict(model.named_modules())
    out: dict[Node, str] = {}
    rows: list[dict[str, Any]] = []
    is_tensor = {n: True for n in model.graph.nodes}
    for node in model.graph.nodes:
        module = modules.get(node.target) if node.op == "call_module" else None
        inputs = [out.get(n, "float32") for n in tensor_inputs(node, is_tensor)]
        status = node.meta.get("fxq_status")
        qconfig = getattr(module, "qconfig_source", None) or node.meta.get("fxq_qconfig", "")
        unsupported = ""
        march = ""
        if node.op in ("placeholder", "get_attr"):
            output = "float32"
        elif node.op == "output":
            output = ", ".join(inputs)
        elif isinstance(module, QATModule):
            output, march = _fake_quant(module.activation_post_process), "yes"
        elif isinstance(module, Quantize):
            output, march = _quant(module.dtype, module.scale), "yes"
        elif isinstance(module, Standalone):
            output, march = "float32 (standalone integer op)", "yes"
        elif isinstance(module, QuantizedModule):
            if getattr(module, "high_precision", False):
                output = "int32 accumulator -> float32"
            else:
                output = _quant(module.out_dtype, module.output_scale)
            march = "yes"
        elif isinstance(module, DeQuantize):
            output = "float32"
        else:
            rule, _ = row_for(node, modules)
            if (
                rule.kind is Kind.PASSTHROUGH
                and inputs
                and inputs[0] != "float32"
                and status != "float"
            ):
                output, march = inputs[0], "yes"
            elif rule.kind is Kind.NONTENSOR:
                output = "python value"
            elif status == "value":  # prepare saw an integer / bool tensor (ids, positions)
                output = "integer tensor"
            else:
                output = "float32"
                if is_opaque_call(node):
                    status = "opaque"
                listed = "fxq_float_reason" in node.meta  # prepare's FloatOpWarning lists it
                if (status == "float fallback" and listed) or (
                    status is None
                    and rule.kind is Kind.FLOAT
                    and any(i != "float32" for i in inputs)
                ):
                    unsupported, march = "yes: runs in float", "no"
        out[node] = output
        rows.append(
            {
                "node": node.name,
                "op": node.op,
                "type": _type_name(node, module),
                "inputs": ", ".join(inputs),
                "output": output,
                "qconfig": qconfig,
                "march": march,
                "unsupported": unsupported,
            }
        )
    if show:
        print(tabulate([[r[c] for c in _COLUMNS] for r in rows], headers=list(_COLUMNS)))
    return rows
