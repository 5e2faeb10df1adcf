"""The primitive registry and the recording of primitive calls.

A primitive is one piece of integer arithmetic, defined once (DESIGN.md, "Integer
primitives"): its module in ``fxq.primitives`` holds, side by side,

* the torch kernel an integer module's ``forward`` calls (a ``torch.library`` op
  ``fxq::<name>`` with a fake kernel, so ``torch.export`` and ``torch.compile`` record it
  as one op; eager calls run the same Python kernel directly, without the dispatcher);
* ``numpy``: the kernel of ``fxq.export.runtime`` (``kernel(node, inputs) -> outputs``);
* ``onnx``: its lowering into the integer ONNX (``lowering(writer, node, outs)``), and
  ``qdq`` where the QDQ form differs (None: the integer lowering);
* ``spec``: what an ``.fxq`` file may hold for its IR node (``fxq.primitives.schema``).

Export records what forward does: while ``fxq.export.to_graph`` runs an integer module
whose class has no export rule, every primitive call its thread makes is reported to the exporter
(``recording``), with its input and output tensors, its attributes and its arrays, and
becomes one IR node. Outside a recording a primitive pays one thread-local read.

This module imports the standard library only: the numpy runtime loads it without torch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fxq.primitives.schema import OpSpec

__all__ = [
    "Primitive",
    "PRIMITIVES",
    "register",
    "recording",
    "record",
    "is_recording",
    "Call",
    "ir_dtype",
    "record_built",
    "NotExportable",
    "traced",
]

#: ``kernel(node, inputs) -> outputs`` (``fxq.export.runtime``)
NumpyKernel = Callable[[Any, list[Any]], list[Any]]
#: ``lowering(writer, node, outs)``: writes ONNX nodes computing ``node`` into ``outs``
Lowering = Callable[[Any, Any, list[str]], None]


@dataclass(frozen=True)
class Primitive:
    """One IR op and everything that computes it outside torch.

    Attributes:
        name: the IR op (``Node.op``) and the ``fxq::`` op's name.
        numpy: the numpy reference kernel.
        onnx: the integer-ONNX lowering.
        spec: what a file may hold for the node.
        qdq: the QDQ-ONNX lowering, None when the integer one serves.
        doc: one line for docs/integer_graph.md's op table.
    """

    name: str
    numpy: NumpyKernel
    onnx: Lowering
    spec: OpSpec
    qdq: Lowering | None = None
    doc: str = ""


#: IR op -> its primitive (filled by the family modules when ``fxq.primitives`` is imported)
PRIMITIVES: dict[str, Primitive] = {}


def register(primitive: Primitive) -> Primitive:
    """Add a primitive to ``PRIMITIVES``; a second definition of one op is an error."""
    if primitive.name in PRIMITIVES:
        raise ValueError(f"primitive {primitive.name!r} is defined twice")
    PRIMITIVES[primitive.name] = primitive
    return primitive


@dataclass
class Call:
    """One recorded primitive call.

    Attributes:
        op: the primitive (IR op).
        inputs: the torch tensors it read (graph values: each must be an exported tensor).
        outputs: the tensors it returned.
        dtypes: each output's IR dtype (``"int8"``...: a tensor may carry exact integers in
            float32).
        attrs: the IR node's JSON attributes.
        params: the IR node's arrays (torch tensors or numpy arrays; converted on export).
        scales: each output's quantization scale where the caller knows it (an operand moved
            onto the output grid inside a module); a module's results take theirs from the
            QTensors it returns.
        axis0: how the op uses its first input's axis 0: ``"any"``; ``"not_batch"`` (it
            reduces over it: where that axis is the batch, the graph's batch size is fixed); ``"batch"`` (it
            needs it to be the batch: GroupNorm's per-sample statistics).
        keeps_batch: for a move, whether the output's axis 0 is the first input's (the
            dynamic batch stays dynamic: a ``reshape`` then writes 0 for it); None: the
            exporter tells from the shapes.
        counts: for a ``requantize`` after window sums, the multiplier and shift for other
            element counts (``counts -> (multipliers, shifts)``, numpy): a mean over axes that
            are dynamic at export takes them from a table (``fxq.export.dynamic``).
    """

    op: str
    inputs: Sequence[Any]
    outputs: Sequence[Any]
    dtypes: Sequence[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    params: Mapping[str, Any] = field(default_factory=dict)
    scales: Sequence[float | None] | None = None
    axis0: str = "any"
    keeps_batch: bool | None = None
    counts: Callable[[Any], tuple[Any, Any]] | None = None


class NotExportable(ValueError):
    """A primitive call that has no exported form (e.g. an unbatched convolution); export
    raises its message as an ``ExportError`` naming the node."""


class _State(threading.local):
    recorder: Callable[[Call], None] | None = None


_state = _State()  # per thread: a model running in another thread is not recorded


def is_recording() -> bool:
    """Whether an export is recording this thread's primitive calls (primitives then build
    their ``Call``)."""
    return _state.recorder is not None


@contextlib.contextmanager
def recording(recorder: Callable[[Call], None]) -> Iterator[None]:
    """Report every primitive call this thread makes inside the block to ``recorder``.

    Raises:
        RuntimeError: a recording is already active in this thread.
    """
    if _state.recorder is not None:
        raise RuntimeError("fxq.primitives: a recording is already active")
    _state.recorder = recorder
    try:
        yield
    finally:
        _state.recorder = None


def record(call: Call) -> None:
    """Report a primitive call to this thread's recording, if one is active."""
    recorder = _state.recorder
    if recorder is not None:
        recorder(call)


def record_built(
    op: str,
    inputs: Sequence[Any],
    output: Any,
    dtype: str,
    build: Callable[[], tuple[dict[str, Any], Mapping[str, Any]]],
    axis0: str = "any",
) -> None:
    """Record a call whose kernel is the module's own (a convolution, a normalization):
    ``op`` read ``inputs`` and made ``output`` (IR dtype ``dtype``); ``build()`` gives the
    node's attributes and arrays from what it computed with, and runs only while an export
    records; ``axis0`` as in ``Call``."""
    if _state.recorder is not None:
        attrs, params = build()
        record(Call(op, list(inputs), [output], [dtype], attrs, params, axis0=axis0))


def traced() -> bool:
    """Whether a primitive should call its ``torch.library`` op (``fxq::<name>``) rather than
    its kernel: while ``torch.compile`` or ``torch.export`` traces, so the graph holds the
    primitive as one op. Eager calls run the kernel directly, without the dispatcher."""
    import torch

    return torch.compiler.is_compiling()


def ir_dtype(qdtype: Any) -> str:
    """The IR dtype of an ``fxq.QDType`` (``qint8`` -> ``"int8"``)."""
    return qdtype.name.removeprefix("q")
