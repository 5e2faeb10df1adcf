"""Evaluate a model as one CUDA graph: no per-op launch cost from Python.

An integer model runs more, smaller kernels than its float model (requantizations,
im2col copies), and in eager mode the host issues each one, so on a fast GPU a small
model waits on Python rather than on the device. ``graphed`` captures the model's
forward once and replays it, as ``torch.compile(mode="reduce-overhead")`` does for
float models::

    from fxq.utils.cuda_graph import graphed

    integer = fxq.convert_fx(qat).cuda().eval()
    fast = graphed(integer, images[:64].cuda())
    for x, y in loader:          # batches of the example's shape replay the graph
        logits = fast(x.cuda())  # a last, smaller batch runs eagerly

The replay computes what the model computes (the same kernels on the same inputs), so
an fxq integer model stays bit-exact. A graph is a snapshot: the model's parameters and
buffers must not change after the capture (``graphed`` checks their version counters on
each call and refuses a changed model), and its forward must not read device values on
the host (fxq's integer models do not, after their first call).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["graphed", "GraphedModule"]


def _signature(inputs: tuple[Any, ...]) -> tuple:
    leaves, spec = tree_flatten(inputs)
    return spec, tuple(
        (tuple(t.shape), t.dtype, t.device) if isinstance(t, Tensor) else t for t in leaves
    )


class GraphedModule(nn.Module):
    """``model`` replayed from one CUDA graph for inputs shaped as the example (see
    ``graphed``); other inputs run ``model`` eagerly."""

    def __init__(self, model: nn.Module, example_inputs: tuple[Any, ...], warmup: int = 2):
        super().__init__()
        leaves, _ = tree_flatten(example_inputs)
        tensors = [t for t in leaves if isinstance(t, Tensor)]
        if not tensors or any(t.device.type != "cuda" for t in tensors):
            raise ValueError(
                "fxq.utils.cuda_graph.graphed: the example inputs must be CUDA tensors "
                f"(got devices {sorted({str(t.device) for t in tensors}) or 'none'}); move "
                "the model and the example to the GPU first"
            )
        self.model = model
        self._signature = _signature(example_inputs)
        self._static = tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, example_inputs)
        self._versions = self._state_versions()
        device = tensors[0].device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.no_grad(), torch.cuda.stream(stream):
            for _ in range(warmup):  # fills the model's caches outside the capture
                model(*self._static)
        torch.cuda.current_stream(device).wait_stream(stream)
        self._graph = torch.cuda.CUDAGraph()
        try:
            with torch.no_grad(), torch.cuda.graph(self._graph):
                self._output = model(*self._static)
        except RuntimeError as error:
            raise RuntimeError(
                f"fxq.utils.cuda_graph.graphed: {type(model).__name__}'s forward cannot be "
                "captured as a CUDA graph; it probably reads a device value on the host "
                "(.item(), bool(tensor), a copy to the CPU) or changes its inputs' shapes. "
                f"Run it eagerly instead. Cause: {str(error).splitlines()[0]}"
            ) from error
        if self._state_versions() != self._versions:
            raise RuntimeError(
                "fxq.utils.cuda_graph.graphed: the model changed its own parameters or "
                "buffers during the capture (a training-mode layer?); call .eval() first"
            )

    def _state_versions(self) -> tuple[int, ...]:
        return tuple(t._version for t in (*self.model.parameters(), *self.model.buffers()))

    def forward(self, *inputs: Any) -> Any:
        if _signature(inputs) != self._signature:
            return self.model(*inputs)
        if self._state_versions() != self._versions:
            raise RuntimeError(
                "fxq.utils.cuda_graph.graphed: the model's parameters or buffers changed "
                "after its CUDA graph was captured (the graph would use the old values); "
                "call graphed(model, example) again"
            )
        for static, given in zip(tree_flatten(self._static)[0], tree_flatten(inputs)[0]):
            if isinstance(static, Tensor):
                static.copy_(given)
        self._graph.replay()
        return tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, self._output)


def graphed(model: nn.Module, *example_inputs: Any, warmup: int = 2) -> GraphedModule:
    """``model`` (on CUDA, in eval mode) captured as one CUDA graph for inputs of the shapes,
    dtypes and structure of ``example_inputs``.

    Args:
        model: a model whose forward reads no device value on the host (an fxq integer
            model, a float model).
        example_inputs: CUDA tensors (or nested containers of them) as the model takes them.
        warmup: eager calls before the capture (they fill the model's caches).

    Returns:
        a module that replays the graph for inputs of the example's signature and runs
        ``model`` eagerly for others; its outputs are fresh tensors.

    Raises:
        ValueError: the example inputs are not on CUDA.
        RuntimeError: the forward cannot be captured (it names the cause), or later, the
            model's parameters or buffers changed after the capture.
    """
    return GraphedModule(model, example_inputs, warmup)
