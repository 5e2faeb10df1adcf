"""Issue 30: every converted model family exports, bit for bit.

Each model (random init, small sizes, nothing downloaded) is prepared for the bayes march with
the default int8 qconfig, calibrated on two batches, converted, then exported with
``fxq.export.to_graph`` and ``fxq.export.to_onnx`` (integer mode); on a third input (and on
another batch size where the graph's batch is dynamic) the numpy runtime and onnxruntime give
the integer model's outputs exactly (``np.array_equal``).

The parts that used to stop the export, one per family: ConvNeXt's layer scale (a parameter
times the graph's value), ViT's class token (``cls.expand(B, -1, -1)`` and ``torch.cat``),
Swin's shifted-window mask (``x.new_zeros((H, W))`` filled by slices) and its and LeViT's
relative-position biases (``table[index]`` by a buffer), MobileViT's unfold / fold reshapes,
BERT's ``position_ids[:, :L]`` buffer slice and GPT-2's ``input_ids.view(-1, L)``.

Sizes: torchvision ConvNeXt and Swin with two stages (every block type: ConvNeXt's block with
its layer scale and downsampling, Swin's plain and shifted windows and patch merging), the ViT,
LeViT and MobileViT of ``tests/models/test_model_families.py``, one-layer BERT and GPT-2 of
hidden size 32. Models whose reshapes merge the batch into another axis (windows, patches,
GPT-2's ``Conv1D``) export with a fixed batch size (``docs/integer_graph.md``, 1).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

import fxq
import fxq.export
from tests.export.helpers import (
    assert_exact_in_runtimes,
    convert_calibrated,
    hf_model,
    outputs,
)

pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")
pytest.importorskip("torchvision")
from tests.models.test_model_families import CASES as FAMILIES  # noqa: E402 (needs timm)


def _convnext() -> tuple[nn.Module, dict]:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    # convnext_tiny's blocks in two stages; a layer scale of 0.5 instead of 1e-6 so that the
    # blocks' branches are not rounded away
    stages = [CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)]
    return ConvNeXt(stages, layer_scale=0.5, num_classes=10), {}


def _swin() -> tuple[nn.Module, dict]:
    from torchvision.models.swin_transformer import SwinTransformer

    # swin_t's blocks: on the 8x8 map of a 32x32 image a plain and a shifted 4x4 window
    model = SwinTransformer(
        patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4],
        num_classes=10,
    )  # fmt: skip
    return model, {}


def _family(name: str) -> Callable[[], tuple[nn.Module, dict]]:
    return lambda: (FAMILIES[name].build(), {})


def _vit() -> tuple[nn.Module, dict]:
    model, _ = _family("vit (torchvision VisionTransformer)")()
    nn.init.normal_(model.heads.head.weight, std=0.2)  # torchvision zeroes it: constant logits
    return model, {}


def _images(shape: tuple[int, ...]) -> Callable[[int, int], tuple[torch.Tensor]]:
    def make(batch: int, seed: int) -> tuple[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn((batch, *shape[1:]), generator=g),)

    return make


def _ids(batch: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 100, (batch, 8), generator=g)}


@dataclass(frozen=True)
class Case:
    build: Callable[[], tuple[nn.Module, dict]]  # the float model and prepare's extra arguments
    inputs: Callable[[int, int], tuple | dict]  # (batch, seed) -> the model's inputs
    dynamic_batch: bool  # whether the graph takes any batch size


CASES = {
    "convnext (torchvision)": Case(_convnext, _images((2, 3, 32, 32)), True),
    "vit (torchvision)": Case(_vit, _images((2, 3, 32, 32)), True),
    "swin (torchvision)": Case(_swin, _images((2, 3, 32, 32)), False),
    "levit_128s (timm)": Case(_family("levit_128s"), _images(FAMILIES["levit_128s"].shape), False),
    "mobilevit_xxs (timm)": Case(
        _family("mobilevit_xxs"), _images(FAMILIES["mobilevit_xxs"].shape), False
    ),
    "bert (transformers, input_ids)": Case(lambda: hf_model("bert", hidden=32), _ids, True),
    "gpt2 (transformers, input_ids)": Case(lambda: hf_model("gpt2", hidden=32), _ids, False),
}


@functools.cache
def _exported(name: str):
    """The integer model, its IntegerGraph and its integer ONNX (built once per session)."""
    case = CASES[name]
    torch.manual_seed(0)
    model, extra = case.build()
    integer = convert_calibrated(model, [case.inputs(2, 1), case.inputs(2, 2)], **extra)
    example = case.inputs(2, 3)
    graph = fxq.export.to_graph(integer, example)
    onnx_model = fxq.export.to_onnx(integer, example, mode="integer")
    return integer, graph, onnx_model


@pytest.mark.parametrize("name", list(CASES))
def test_model_family_exports_bit_exact(name):
    integer, graph, onnx_model = _exported(name)
    case = CASES[name]
    assert graph.dynamic_batch is case.dynamic_batch
    inputs = case.inputs(2, 4)
    expected = outputs(integer, inputs)
    assert sum(e.size for e in expected) >= 20 and all(np.isfinite(e).all() for e in expected)
    assert len({e.tobytes() for e in expected[0]}) > 1  # the samples differ: nothing constant
    # integer all through: no float region (``docs/integer_graph.md``, 2, "Float regions")
    assert not [n.name for n in graph.nodes if n.op.startswith("float_")]
    assert_exact_in_runtimes(integer, graph, onnx_model, inputs)
    if case.dynamic_batch:
        assert_exact_in_runtimes(integer, graph, onnx_model, case.inputs(3, 5))


# -- the two exporter fixes, on a small model --------------------------------------------------
class _Constants(nn.Module):
    """Swin's mask pattern: ``x.new_zeros(size)`` filled by slices, and ``torch.ones_like(x)``
    (values made from the shape of a graph value, not from its data, are constants); ConvNeXt's
    layer scale (a parameter as the first operand keeps the batch axis dynamic)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.dq = fxq.QuantStub(), fxq.DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.gamma = nn.Parameter(torch.rand(4, 1, 1) + 0.5)

    def forward(self, x):
        y = self.gamma * self.conv(self.q(x))
        mask = x.new_zeros(x.shape[-2:])
        mask[: x.shape[-2] // 2, 1:] = 0.5
        mask[x.shape[-2] // 2 :, :1] = -1.0
        return self.dq(y * (mask + 1.0)), torch.ones_like(x) * 2.0 - x


def test_shape_made_values_are_constants_and_a_constant_first_operand_keeps_the_batch():
    data = [(torch.randn(2, 3, 6, 6),), (torch.randn(2, 3, 6, 6),)]
    integer = convert_calibrated(_Constants(), data)
    graph = fxq.export.to_graph(integer, torch.randn(2, 3, 6, 6))
    assert graph.dynamic_batch
    assert all(graph.tensors[o].shape[0] == "N" for o in graph.outputs)
    constants = [n for n in graph.nodes if n.op == "constant"]
    assert [n.attrs["batch"] for n in constants].count(True) == 1  # ones_like(x): one row
    onnx_model = fxq.export.to_onnx(integer, torch.randn(2, 3, 6, 6), mode="integer")
    for batch in (2, 3):
        assert_exact_in_runtimes(integer, graph, onnx_model, (torch.randn(batch, 3, 6, 6),))
