"""``to_graph``: a converted fxq model -> ``IntegerGraph``.

The converted GraphModule runs once on the example inputs under an
``torch.fx.Interpreter``; every node is turned into IR nodes by an export
rule. The rules:

* ``record_calls``: an integer module (every one: its forward computes with
  ``fxq.primitives``) runs while its primitive calls are recorded, and each call
  becomes one IR node, with what the module computed *for the scales its inputs
  actually carry* (so a graph edit that changes a scale is exported as the model
  computes it): export is what forward did, never a re-derivation of it;
* ``VALUE_RULES``: pass-through registry rows that compute on values (ReLU,
  max pooling);
* every other pass-through row only moves integers: its rule applies the float
  op to a tensor of source indices and exports what it finds (an alias, a
  reshape, a transpose or a gather);
* ``FLOAT_RULES``: the elementwise float arithmetic of float regions (IEEE-exact
  elementwise float32 arithmetic);
* ``fxq.export.float_ops.FLOAT_OP_RULES``: the other float ops a float region may contain
  (convolution, linear, normalization, activations, softmax, pooling, resampling,
  reductions, cat / stack), each one IR node of ``fxq.export.runtime_float``.

A node without a rule raises ``ExportError`` naming the node, its op and its
source line.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.fx import GraphModule, Interpreter, Node
from torch.utils._pytree import tree_flatten

from fxq import registry
from fxq.export.common import _dtype
from fxq.export.dynamic import Dim, merge_probes, probe_inputs, probe_size, resolve_dims
from fxq.export.float_ops import float_op_rule
from fxq.export.graph import IntegerGraph, TensorInfo
from fxq.export.graph import Node as IRNode
from fxq.export.moves import (
    FLOAT_RULES,
    MOVEMENT_CUSTOM_ROWS,
    VALUE_RULES,
    _float_op,
    _movement,
    value_rule,
)
from fxq.export.plain import CAST_METHODS, TORCH_DTYPES, cast_rule, materialize, plain_rule
from fxq.fx.graph_utils import reads_metadata_only
from fxq.fx.tracer import SELF, call_wrapped_method, check_decided, is_size_read, size_reads
from fxq.primitives import Call, recording
from fxq.primitives.core import NotExportable
from fxq.qat.base import QATModule
from fxq.qtensor import QTensor
from fxq.quantized.base import QuantizedModule, Standalone
from fxq.quantized.stubs import DeQuantize
from fxq.registry import Kind

__all__ = [
    "to_graph",
    "Dim",
    "ExportError",
    "VALUE_RULES",
    "FLOAT_RULES",
    "rule_for_row",
    "rule_for_module",
    "record_calls",
]


def _array(v: Any) -> np.ndarray:
    """A recorded parameter as the numpy array the IR stores."""
    if isinstance(v, Tensor):
        return v.detach().cpu().numpy().copy()
    return np.asarray(v)


def _held(v: Any) -> list[int]:
    """The ids of the torch tensors a value holds: a tensor itself, or a QTensor's integers in
    both forms (storage and exact float32: a primitive made one of them)."""
    if isinstance(v, QTensor):
        return [id(v.values()), id(v.data)]
    return [id(v)]


class ExportError(RuntimeError):
    """A node of the converted model cannot be exported (the message names it)."""


class _Exporter(Interpreter):
    """Runs the converted model and records one or more IR nodes per FX node."""

    def __init__(self, gm: GraphModule, stop_at: list[str] | None = None) -> None:
        super().__init__(gm)
        # fxq's errors name the node and its source line; torch.fx would append the node's
        # FX form and a pointer to tlparse (other errors get the node in a note: ``_export``)
        self.extra_traceback = False
        self.stop_at = stop_at  # FX node names whose values are the graph's outputs
        #: per size read (``is_size_read``): its tensor's rank and whether axis 0 is the batch
        self.sized: dict[Node, tuple[int, bool]] = {}
        self.values: dict[str, Any] = {}
        self.modules = dict(gm.named_modules())
        self.nodes: list[IRNode] = []
        self.tensors: dict[str, TensorInfo] = {}
        self.names: dict[int, str] = {}
        self.constants: dict[int, Node] = {}  # values no graph input feeds -> their FX node
        self.batched: dict[str, bool] = {}
        self.keep: list[Any] = []  # keeps mapped objects alive (their ids stay unique)
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.batch: int | None = None
        self.fixed: list[str] = []  # why the batch dimension is not dynamic
        self.fx_node: Node | None = None
        # requantize node -> its multiplier and shift for other element counts (dynamic dims)
        self.counts: dict[str, Any] = {}
        # FX node -> the primitive calls its integer module made (fxq.primitives.recording)
        self.captures: dict[str, list[Call]] = {}

    # -- bookkeeping -------------------------------------------------------------------------
    def error(self, reason: str) -> ExportError:
        n = self.fx_node
        what = (
            registry.target_name(n.target)
            if n.op != "call_module"
            else type(self.modules[n.target]).__name__
        )
        source = n.meta.get("fxq_source", "") or "unknown source"
        return ExportError(
            f"fxq.export: cannot export node {n.name!r} ({n.op} {what}, {source}): {reason}"
        )

    def name_of(self, obj: Any) -> str:
        name = self.names.get(id(obj))
        if name is None and id(obj) in self.constants:
            return materialize(self, obj, self.constants[id(obj)])
        if name is None:
            raise self.error(
                f"its input ({type(obj).__name__}) was not produced by an exported op (a value "
                "computed outside the graph, e.g. a constant tensor or an index tensor)"
            )
        return name

    def register(self, obj: Any, name: str, batched: bool, info: TensorInfo | None = None) -> str:
        """Name ``obj`` as an IR tensor; ``info`` (a primitive's output) overrides what its type
        says."""
        if info is None:
            info = self._info(obj)
        base, i = name, 1
        while name in self.tensors:
            i += 1
            name = f"{base}_{i}"
        self.tensors[name] = info
        self.batched[name] = batched and info.shape[:1] == [self.batch]
        self.names[id(obj)] = name
        self.keep.append(obj)
        return name

    def _info(self, obj: Any) -> TensorInfo:
        if isinstance(obj, QTensor):
            return TensorInfo(_dtype(obj), list(obj.shape), float(obj.scale), obj.offset)
        if isinstance(obj, Tensor):
            dtype = TORCH_DTYPES.get(obj.dtype)
            if dtype is None:
                raise self.error(
                    f"tensors of {obj.dtype} are not exported (float32, and int32 / int64 / bool "
                    "for ids and masks)"
                )
            return TensorInfo(dtype, list(obj.shape), None)
        raise self.error(f"cannot export a value of type {type(obj).__name__}")

    def alias(self, obj: Any, name: str) -> None:
        self.names[id(obj)] = name
        self.keep.append(obj)

    def emit(
        self,
        op: str,
        inputs: list[str],
        outputs: list[Any],
        attrs: dict[str, Any] | None = None,
        params: dict[str, np.ndarray] | None = None,
        batched: bool | None = None,
        suffix: str = "",
        infos: list[TensorInfo] | None = None,
    ) -> list[str]:
        n = self.fx_node
        if batched is None:
            # an output's axis 0 of the batch's size is the batch when any input has it (also
            # after a constant first operand: ConvNeXt's ``layer_scale * x``)
            batched = any(self.batched.get(i, False) for i in inputs)
        names = [
            self.register(
                o,
                n.name + suffix + (f"_{i}" if len(outputs) > 1 else ""),
                batched,
                infos[i] if infos is not None else None,
            )
            for i, o in enumerate(outputs)
        ]
        node_name = n.name + suffix
        existing = {x.name for x in self.nodes}
        k = 1
        while node_name in existing:
            k += 1
            node_name = f"{n.name}{suffix}_{k}"
        self.nodes.append(
            IRNode(
                node_name,
                op,
                inputs,
                names,
                attrs or {},
                params or {},
                n.meta.get("fxq_source", ""),
            )
        )
        return names

    # -- interpretation ----------------------------------------------------------------------
    def run_node(self, n: Node) -> Any:
        self.fx_node = n
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if is_size_read(n) and isinstance(args[0], (Tensor, QTensor)):
            # what a condition decided at tracing may read (``_check_decided_axis0``); the
            # tensor itself may be freed by then
            name = self.names.get(id(args[0]))
            self.sized[n] = (args[0].dim(), bool(name and self.batched.get(name)))
        if n.op == "call_function" and n.target is call_wrapped_method:
            # the generated code passes the GraphModule where the graph says ``self``
            args = tuple(self.module if a is SELF else a for a in args)
        if n.op == "call_module" and rule_for_module(self.modules[n.target]) is record_calls:
            calls: list[Call] = []
            try:
                with recording(calls.append):
                    result = self.call_module(n.target, args, kwargs)
            except NotExportable as e:
                raise self.error(str(e)) from None
            self.captures[n.name] = calls
        else:
            result = getattr(self, n.op)(n.target, args, kwargs)
        if n.op == "call_function" and n.target is check_decided:
            self._check_decided_axis0(n)
            return result
        if self.stop_at is not None:
            if all(name in self.values for name in self.stop_at):
                return result  # the rest (host post-processing) is not exported
            if n.name in self.stop_at:
                self.values[n.name] = result
        if n.op == "output" and self.stop_at is not None:
            missing = [name for name in self.stop_at if name not in self.values]
            raise ExportError(f"fxq.export: no node named {missing} in the converted graph")
        if n.op == "placeholder":
            self._placeholder(n, result)
        elif n.op == "get_attr":
            self._constant(n, result)
        elif n.op == "output":
            self._output(args)
        elif n.op in ("call_module", "call_function", "call_method"):
            self._call(n, args, kwargs, result)
        return result

    def _check_decided_axis0(self, n: Node) -> None:
        """A branch decided at tracing from the batch size (``if x.shape[0] == 1:``) holds
        for the example's batch only: the graph's batch size is fixed to it."""
        for read in size_reads(n.args[0]) or []:
            rank, batched = self.sized.get(read, (0, False))
            if batched and _reads_axis0(read, rank):
                self.fixed.append(f"{n.name}: a branch decided from the batch size")
                return

    def _placeholder(self, n: Node, value: Any) -> None:
        if not isinstance(value, Tensor):
            return  # a Python value: baked in
        if self.batch is None:
            self.batch = value.shape[0] if value.dim() else None
        if value.dtype not in TORCH_DTYPES:
            raise self.error(
                f"graph input of dtype {value.dtype}: inputs are float32 (images, features), "
                "int64 / int32 (token ids, integer masks) or bool (masks); convert the example "
                "input"
            )
        self.inputs.append(self.register(value, n.name, True))

    def _constant(self, n: Node, result: Any) -> None:
        """Record the tensors of ``result`` as constants made by ``n`` (no graph input feeds
        them); one becomes a ``constant`` node when an exported op reads it."""
        for v in tree_flatten(result)[0]:
            if isinstance(v, (Tensor, QTensor)) and id(v) not in self.names:
                self.constants[id(v)] = n
                self.keep.append(v)

    def _output(self, args: tuple) -> None:
        leaves, _ = tree_flatten(args[0])
        for leaf in leaves:
            if isinstance(leaf, (Tensor, QTensor)):
                self.outputs.append(self.name_of(leaf))

    def _moves_plain(self, n: Node, leaves: list[Any], result: Any) -> bool:
        """Whether ``n`` only moves the values of a plain tensor (a ``flatten`` after a
        dequantize, a mask's ``[:, None, None, :]`` or ``expand``, ``input_ids.view(-1, L)``):
        exported as integers are, by the positions it moves them to (values are moved, never
        computed). The other tensors it reads must be constants (indices)."""
        if any(isinstance(v, QTensor) for v in leaves):
            return False
        if n.op == "call_method" and n.target in CAST_METHODS:
            src = next(v for v in leaves if isinstance(v, Tensor))
            if not isinstance(result, Tensor) or result.dtype != src.dtype:
                return False  # a cast
        row, _ = registry.row_for(n, self.modules)
        return row.kind is Kind.PASSTHROUGH and rule_for_row(row) is _movement

    def _call(self, n: Node, args: tuple, kwargs: dict, result: Any) -> None:
        module = self.modules.get(n.target) if n.op == "call_module" else None
        leaves = tree_flatten((args, kwargs))[0]
        tensors = [v for v in tree_flatten(result)[0] if isinstance(v, (Tensor, QTensor))]
        # ``x.new_zeros(shape)``, ``torch.ones_like(x)``: x's shape and dtype only, not its data
        data = tree_flatten((args[1:], kwargs))[0] if reads_metadata_only(n) else leaves
        graph = [v for v in data if isinstance(v, (Tensor, QTensor)) and id(v) in self.names]
        if tensors and not graph:  # computed from constants only (buffers, sizes): a constant
            self._constant(n, result)
            return
        if module is not None:
            rule = rule_for_module(module)
            if rule is not None:
                rule(self, module, args, kwargs, result)
                return
            if isinstance(module, Standalone):
                raise self.error(
                    "a quantized op called from opaque code (Standalone) has no graph position; "
                    "trace through the code (remove @fxq.fx_wrap) to export it"
                )
        if graph and n.op == "call_function" and n.target is operator.setitem:
            raise self.error(
                "item assignment (x[i] = v) writes graph values into a tensor in place, which is "
                "not exported; build the tensor with torch.where / torch.cat instead"
            )
        if not tensors:
            return  # shapes and other Python values: baked into the graph
        # a container of values the graph has (a namedtuple or dataclass output), or one taken
        # out of it; an in-place op on a tensor (``x.add_(1)``) returns it too, and is computed
        tensor_types = (Tensor, QTensor)
        structural = not isinstance(result, tensor_types) or not (
            args and isinstance(args[0], tensor_types)
        )
        if structural and {id(v) for v in tensors} <= {id(v) for v in leaves}:
            return
        if any(isinstance(v, QTensor) for v in graph):
            row, _ = registry.row_for(n, self.modules)
            if row.kind is not Kind.PASSTHROUGH:
                raise self.error(
                    f"registry row {row.name!r} ({row.kind.value}) on an integer tensor has no "
                    "export rule"
                )
            rule = rule_for_row(row)
            if rule is None:
                raise self.error(
                    f"pass-through row {row.name!r} has no export rule (add it to "
                    "fxq.export.moves.VALUE_RULES, or to MOVEMENT_CUSTOM_ROWS if it only moves "
                    "integers)"
                )
            rule(self, n, module, args, kwargs, result)
            return
        self._call_plain(n, module, args, kwargs, result, leaves)

    def emit_calls(self, args, kwargs, result: Any) -> None:
        """The IR nodes of the primitive calls the current node's integer module made: each
        call's inputs are graph tensors (or constants), its outputs new tensors; the module's
        results take their scales from the QTensors it returned."""
        n = self.fx_node
        calls = self.captures.pop(n.name)
        known: dict[int, str] = {}
        arguments: dict[int, QTensor] = {}  # held tensor -> the QTensor argument holding it
        for v in tree_flatten((args, kwargs))[0]:
            if isinstance(v, QTensor) and id(v) in self.names:
                known.update(dict.fromkeys(_held(v), self.names[id(v)]))
            elif isinstance(v, QTensor):  # a constant (materialized where a call reads it)
                arguments.update(dict.fromkeys(_held(v), v))
        results = [v for v in tree_flatten(result)[0] if isinstance(v, (Tensor, QTensor))]
        final = {k: r for r in results for k in _held(r)}
        for k, call in enumerate(calls):
            self._check_axis0(call, known.get(id(call.inputs[0])) if call.inputs else None)
            inputs = []
            for t in call.inputs:
                name = known.get(id(t))
                if name is None:
                    name = self.name_of(arguments.get(id(t), t))
                    known[id(t)] = name
                inputs.append(name)
            self._check_broadcast(call, inputs)
            outputs = []
            scales = call.scales or [None] * len(call.outputs)
            for t, dtype, scale in zip(call.outputs, call.dtypes, scales):
                r = final.get(id(t))
                if isinstance(r, QTensor):
                    info = TensorInfo(dtype, list(t.shape), float(r.scale), r.offset)
                else:
                    info = TensorInfo(dtype, list(t.shape), scale)
                outputs.append((t, info))
            suffix = "" if any(id(t) in final for t, _ in outputs) else f"_{call.op}{k}"
            attrs, batched = call.attrs, None
            if call.keeps_batch is not None:  # a move: the batch stays where it was, or not
                batched = call.keeps_batch and self.batched.get(inputs[0], False)
                if batched and call.op == "reshape":
                    attrs = {**attrs, "shape": [0, *attrs["shape"][1:]]}
            names = self.emit(
                call.op,
                inputs,
                [t for t, _ in outputs],
                attrs,
                {key: _array(v) for key, v in call.params.items()},
                batched=batched,
                suffix=suffix,
                infos=[info for _, info in outputs],
            )
            for (t, _), name in zip(outputs, names):
                known[id(t)] = name
            if call.counts is not None:
                self.counts[self.nodes[-1].name] = call.counts
        for r in results:
            name = next((known[k] for k in _held(r) if k in known), None)
            if name is None and id(r) in self.names:
                continue  # an argument returned as it is (a float passing a DeQuantize)
            if name is None:
                raise self.error(
                    f"{type(self.modules[n.target]).__name__} returned a tensor that none of its "
                    "primitive calls made: a forward hook that replaces the module's output "
                    "(remove it, or make it return None), or integer arithmetic outside "
                    "fxq.primitives (compute integer results with fxq.primitives)"
                )
            self.alias(r, name)

    def _check_broadcast(self, call: Call, inputs: list[str]) -> None:
        """A call that meets the dynamic batch with a tensor of the same rank that does not
        carry it but has the example's batch size on axis 0 (a constant attention mask or
        ``where`` condition of one row per sample) fixes the graph's batch size."""
        if self.batch is None or self.batch < 2:
            return
        ranks = {len(self.tensors[i].shape) for i in inputs if self.batched.get(i, False)}
        for i in inputs:
            shape = self.tensors[i].shape
            if not self.batched.get(i, False) and len(shape) in ranks and shape[0] == self.batch:
                self.fixed.append(f"{self.fx_node.name}: {call.op} of {i!r}, of the batch's size")
                return

    def _check_axis0(self, call: Call, first: str | None) -> None:
        """A call's use of its first input's axis 0 against the dynamic batch."""
        batched = first is not None and self.batched.get(first, False)
        if call.axis0 == "not_batch" and batched:  # a sum over samples: as a float op's
            self.fixed.append(f"{self.fx_node.name}: {call.op} across the batch dimension")
        if call.axis0 == "batch" and not batched:
            raise self.error(f"{call.op} of per-sample groups is exported for batched inputs only")

    def _call_plain(self, n: Node, module, args, kwargs, result, leaves: list[Any]) -> None:
        """An op on plain tensors (float regions; ids and masks from graph inputs)."""
        if n.op == "call_function" and n.target is call_wrapped_method:
            raise self.error(
                f"@fxq.fx_wrap method {n.args[1]!r} is opaque Python (host code); export the "
                "network before it: to_graph(model, x, outputs=[<the nodes it takes>])"
            )
        target = type(module) if module is not None else n.target
        float_rule = float_op_rule(target)
        if float_rule is not None and isinstance(result, Tensor):
            float_rule(self, n, module, args, kwargs, result)
            return
        if self._moves_plain(n, leaves, result):
            _movement(self, n, module, args, kwargs, result)
            return
        if any(isinstance(v, QTensor) for v in leaves):
            raise self.error(
                "a plain op reads a constant quantized tensor by a graph value; compute it in "
                "the integer part (an nn.Embedding for a table lookup)"
            )
        if isinstance(result, Tensor):
            if n.op == "call_method" and n.target in CAST_METHODS:
                cast_rule(self, n, module, args, kwargs, result)
                return
            fn = FLOAT_RULES.get(target)
            if fn is None and isinstance(target, str):
                fn = FLOAT_RULES.get(target.rstrip("_"))
            if fn is not None:
                _float_op(self, fn, args, kwargs, result)
                return
            rule = plain_rule(target)
            if rule is not None:
                rule(self, n, module, args, kwargs, result)
                return
        raise self.error(
            "float op without an export rule (exported float ops: neg, add, sub, mul, div; "
            "conv1d/2d/3d, linear, matmul / bmm, batch_norm, layer_norm, relu, relu6, gelu, "
            "sigmoid, tanh, silu, hardswish, hardsigmoid, hardtanh / clamp, exp, log, sqrt, abs, "
            "softmax, log_softmax, max / avg / adaptive-avg pooling, interpolate (nearest, "
            "bilinear, linear), mean, sum, amax, amin, cat, stack; on ids and masks also casts, "
            "comparisons, logical and / or / xor / not, where, masked_fill; and ops that move "
            "values); " + self._float_op_advice()
        )

    def _float_op_advice(self) -> str:
        """What to do about the float op of the node being exported: quantize it where it has
        an integer form, else leave it out of the graph."""
        row, _ = registry.row_for(self.fx_node, self.modules)
        if row.integer is not None:
            return "give it a qconfig so that it is quantized, or keep it out of the exported part"
        return (
            "it has no integer form either: export the network before it "
            "(to_graph(model, x, outputs=[<the nodes it reads>])) and run it after the graph"
        )


def _reads_axis0(read: Node, rank: int) -> bool:
    """Whether a size read (``is_size_read``) of a tensor of ``rank`` reads its axis 0:
    ``x.shape`` or ``x.size()`` used whole or indexed through axis 0, ``x.size(0)``,
    ``len(x)``, ``x.numel()``; not ``x.dim()`` or ``x.ndim``."""
    target, args = read.target, read.args
    rank = max(rank, 1)
    if target in ("dim", "ndimension") or (target is getattr and args[1] == "ndim"):
        return False
    if (target is getattr and args[1] == "shape") or (target == "size" and len(args) == 1):
        items = [
            range(rank)[u.args[1]] if u.target is operator.getitem else None for u in read.users
        ]
        return any(i is None or (0 in i if isinstance(i, range) else i == 0) for i in items)
    if target == "size":
        return args[1] % rank == 0
    return True  # len, numel, nelement


def record_calls(ex: _Exporter, module: Any, args, kwargs, result) -> None:
    """The export rule of an integer module whose ``forward`` computes with
    ``fxq.primitives``: ``to_graph`` records the primitive calls while the module runs, and
    each becomes one IR node (what forward did, not a re-derivation of it)."""
    ex.emit_calls(args, kwargs, result)


def rule_for_module(module: Any) -> Any:
    """The export rule of a module: ``record_calls`` for an integer module (and a
    ``DeQuantize``), ``Standalone`` excepted; None for other modules."""
    if isinstance(module, (QuantizedModule, DeQuantize)) and not isinstance(module, Standalone):
        return record_calls
    return None


def rule_for_row(row: registry.OpRow) -> Any:
    """The export rule of a registry row (``OpRow.export`` reads it here), or None.

    * a row with an integer class: ``record_calls`` (its forward's primitive calls), called
      as ``rule(exporter, module, args, kwargs, result)``;
    * a pass-through row: its ``VALUE_RULES`` entry, else the movement rule (a
      ``"custom"`` row only when listed in ``MOVEMENT_CUSTOM_ROWS``), called as
      ``rule(exporter, node, module, args, kwargs, result)``;
    * any other row (float ops, shapes, rows refined per call): None.
    """
    if row.integer is not None:
        return record_calls
    if row.kind is not Kind.PASSTHROUGH:
        return None
    rule = value_rule(row.name)
    if rule is not None:
        return rule
    if row.qtensor == "custom" and row.name not in MOVEMENT_CUSTOM_ROWS:
        return None
    return _movement


# -- entry point ---------------------------------------------------------------------------------
def _positional(quantized: GraphModule, inputs: Mapping[str, Any]) -> tuple:
    """Keyword example inputs in the order of the graph's inputs (keyword-only ones included;
    an input not given takes its default, when the traced graph has one)."""
    placeholders = [n for n in quantized.graph.nodes if n.op == "placeholder"]
    names = [n.target for n in placeholders]
    # an input traced at its default value (``concrete_args``, e.g. a Hugging Face model's
    # ``token_type_ids=None``) keeps it when not given, as calling the model does
    defaults = {n.target: n.args[0] for n in placeholders if n.args}
    unknown = [k for k in inputs if k not in names]
    if unknown:
        raise ExportError(
            f"fxq.export: example_inputs names {unknown}, which the converted graph does not "
            f"take (its inputs: {', '.join(names)})"
        )
    missing = [k for k in names if k not in inputs and k not in defaults]
    if missing:
        raise ExportError(
            f"fxq.export: example_inputs lacks the graph input(s) {missing}; pass every input "
            f"the model was traced with ({', '.join(names)})"
        )
    return tuple(inputs[k] if k in inputs else defaults[k] for k in names)


def to_graph(
    quantized: GraphModule,
    example_inputs: tuple | Tensor | Mapping[str, Tensor],
    outputs: list[str | Node] | None = None,
    dynamic_dims: Mapping[str | int, Mapping[int, str | Dim]] | None = None,
) -> IntegerGraph:
    """Export a converted fxq model to an ``IntegerGraph``.

    The model runs once on ``example_inputs`` on the CPU (a model on another device
    is copied there, and gives the same integers); every node becomes
    IR nodes whose parameters are what the integer modules computed with.
    Dimension 0 of the inputs is the symbolic batch dimension (use a batch of
    2 or more so that it is told apart from other dimensions).

    Args:
        quantized: the model returned by ``fxq.convert_fx`` (float32, eval mode).
        example_inputs: a tensor, a tuple of tensors, or a dict of them by input name
            (keyword and keyword-only inputs).
        outputs: FX nodes (or their names) of ``quantized.graph`` whose values are the
            graph's outputs, in this order; what comes after them is not exported
            (e.g. a detector's ``@fxq.fx_wrap`` post-processing, which runs on the host).
            None: the model's own outputs.
        dynamic_dims: more dynamic dimensions than the batch: input (name, or position) ->
            {axis: symbol}, a symbol being a name or ``fxq.export.Dim(name, min, max)``; the
            same symbol in two inputs is one size, e.g. ``{"x": {2: "H", 3: "W"}}`` or
            ``{"input_ids": {1: Dim("L", max=512)}, "attention_mask": {1: "L"}}``. The model
            is exported once more per symbol at a second size (``max``, else twice the example
            size) to prove every node size-independent (``fxq.export.dynamic``).

    Returns:
        the ``IntegerGraph``; ``graph.run(*numpy_inputs)`` equals
        ``quantized(*example_inputs)`` bit for bit, except in float regions (ops a qconfig of
        None keeps in float), which agree within the tolerance ``docs/integer_graph.md``
        states (2, "Float regions").

    Raises:
        TypeError: ``quantized`` is not a GraphModule, or is a prepared model (not converted).
        ExportError: a node has no export rule (naming the node, its op and source line),
            a name in ``outputs`` is not a node of the graph, or a declared dynamic dimension
            cannot stay dynamic (naming the node, its source line and the symbol).
    """
    if not isinstance(quantized, GraphModule):
        raise TypeError(
            f"fxq.export.to_graph expects the GraphModule returned by fxq.convert_fx, got "
            f"{type(quantized).__name__}"
        )
    if any(isinstance(m, QATModule) for m in quantized.modules()):
        raise TypeError(
            "fxq.export.to_graph expects the integer model from fxq.convert_fx; this is a "
            "prepared (QAT or calibrated) model, whose ops still compute in float with fake "
            "quantization. Convert it first: fxq.export.to_graph(fxq.convert_fx(model), ...)"
        )
    if isinstance(example_inputs, Tensor):
        example_inputs = (example_inputs,)
    elif isinstance(example_inputs, Mapping):
        example_inputs = _positional(quantized, example_inputs)
    march = {m.march for m in quantized.modules() if hasattr(m, "march")}
    if len(march) > 1:
        raise ExportError(f"fxq.export: the model mixes marches {sorted(map(str, march))}")
    names = None if outputs is None else [n if isinstance(n, str) else n.name for n in outputs]
    known = {n.name for n in quantized.graph.nodes}
    unknown = [n for n in names or [] if n not in known]
    if unknown:
        raise ExportError(f"fxq.export: no node named {unknown} in the converted graph")
    if any(t.device.type != "cpu" for t in (*quantized.parameters(), *quantized.buffers())):
        quantized = copy.deepcopy(quantized).cpu()  # the integer arithmetic is device-independent
    example_inputs = tuple(t.detach().cpu() if isinstance(t, Tensor) else t for t in example_inputs)
    graph, ex = _export(quantized, example_inputs, names, march)
    if not dynamic_dims:
        return graph
    placeholders = [n.target for n in quantized.graph.nodes if n.op == "placeholder"]
    by_input, dims, sizes = resolve_dims(
        dynamic_dims, placeholders, example_inputs, lambda m: ExportError(f"fxq.export: {m}")
    )
    where = {
        s: ", ".join(
            f"dimension {a} of input {placeholders[p]!r}"
            for p, axes in sorted(by_input.items())
            for a, t in sorted(axes.items())
            if t == s
        )
        for s in sizes
    }
    probes = {}
    for sym in sizes:
        size = probe_size(dims[sym], sizes[sym])
        try:
            probes[sym], _ = _export(
                quantized, probe_inputs(example_inputs, by_input, sym, size), names, march
            )
        except Exception as e:  # the model itself does not run at that size
            n = getattr(e, "fx_node", None)
            at = (
                f"node {n.name!r} ({n.meta.get('fxq_source', '') or 'unknown source'})"
                if n
                else "a node"
            )
            raise ExportError(
                f"fxq.export: cannot keep {sym!r} ({where[sym]}) dynamic: the model fails at "
                f"{sym}={size} (exported at {sym}={sizes[sym]}) in {at}: {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}; an op fixes the size there (e.g. a "
                "reshape to a fixed size): leave it out of dynamic_dims, or pass "
                f"fxq.export.Dim({sym!r}, max=...) with a size the model runs at"
            ) from e
    return merge_probes(graph, probes, dims, sizes, where, ex.counts, lambda m: ExportError(m))


def _export(
    quantized: GraphModule, example_inputs: tuple, names: list[str] | None, march: set
) -> tuple[IntegerGraph, _Exporter]:
    """One export at the sizes of ``example_inputs`` (the graph and its exporter)."""
    ex = _Exporter(quantized, names)
    with torch.no_grad():
        try:
            ex.run(*example_inputs)
        except Exception as e:
            e.fx_node = ex.fx_node  # type: ignore[attr-defined]  # where it failed
            if not isinstance(e, ExportError) and ex.fx_node is not None:
                source = ex.fx_node.meta.get("fxq_source", "unknown source")
                e.add_note(f"while exporting node {ex.fx_node.format_node()} ({source})")
            raise
    if names is not None:
        for name in names:
            ex.fx_node = next(n for n in quantized.graph.nodes if n.name == name)
            ex._output((ex.values[name],))
    dynamic = not ex.fixed
    tensors = ex.tensors
    if dynamic:
        for name, info in tensors.items():
            if ex.batched.get(name):
                info.shape = ["N", *info.shape[1:]]
    march_name = getattr(next(iter(march)), "value", str(next(iter(march)))) if march else ""
    return IntegerGraph(ex.nodes, tensors, ex.inputs, ex.outputs, march_name, dynamic), ex
