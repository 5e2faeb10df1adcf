"""Shared pieces of the export tests: converted registry-op models and torchvision models."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

import fxq
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig as q8
from tests.helpers import recalibrate_bn
from tests.test_registry import _calibrate, _inputs, _prepare


def registry_model(row_name: str, target: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The registry suite's one-op model for ``target``, calibrated and converted, and an input."""
    qat = _prepare(row_name, target)
    _calibrate(qat, row_name, target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxq.convert_fx(qat), _inputs(row_name, target, 7)


def torchvision_model(name: str, size: int = 64, batch: int = 2) -> tuple[nn.Module, torch.Tensor]:
    """A randomly initialised torchvision model, calibrated on random data and converted."""
    import torchvision

    torch.manual_seed(0)
    kwargs = {"aux_logits": False, "init_weights": False} if name == "googlenet" else {}
    model = getattr(torchvision.models, name)(num_classes=10, **kwargs)
    data = [torch.randn(batch, 3, size, size) for _ in range(2)]
    recalibrate_bn(model, data)  # random init: give BatchNorm real statistics
    model.eval()
    prepared = fxq.prepare_qat_fx(model, {"": q8})
    fxq.set_fake_quantize(prepared, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad():
        for x in data:
            prepared(x)
    fxq.set_fake_quantize(prepared, fxq.FakeQuantState.VALIDATION)
    return fxq.convert_fx(prepared), torch.randn(batch, 3, size, size)


def convert_calibrated(model: nn.Module, batches: list, **prepare_kwargs) -> nn.Module:
    """``model`` prepared for the bayes march with the default int8 qconfig, calibrated on
    ``batches`` (tuples of inputs, or dicts of keyword inputs; the first is prepare's
    ``example_inputs``) and converted."""
    fxq.set_march("bayes")
    first = batches[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qat = fxq.prepare_qat_fx(model.eval(), {"": q8}, example_inputs=first, **prepare_kwargs)
        fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
        with torch.no_grad():
            for b in batches:
                qat(**b) if isinstance(b, dict) else qat(*b)
        fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
        return fxq.convert_fx(qat)


def hf_model(name: str, hidden: int = 64) -> tuple[nn.Module, dict]:
    """A one-layer Hugging Face model (``"bert"``, ``"distilbert"``, ``"gpt2"``; random init,
    ``hidden`` wide, 100 tokens, 64 positions, built from its config: nothing is downloaded)
    and ``prepare_qat_fx``'s extra arguments for it."""
    import transformers as t

    small = {"vocab_size": 100, "max_position_embeddings": 64}
    if name == "bert":
        config = t.BertConfig(
            hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=2 * hidden, **small,
        )  # fmt: skip
        return t.BertModel(config), {}
    if name == "distilbert":
        config = t.DistilBertConfig(
            dim=hidden, n_layers=1, n_heads=2, hidden_dim=2 * hidden, **small
        )  # fmt: skip
        return t.DistilBertModel(config), {}
    assert name == "gpt2", name
    config = t.GPT2Config(
        vocab_size=100, n_embd=hidden, n_layer=1, n_head=2, n_positions=64, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return t.GPT2Model(config), {"concrete_args": {"use_cache": False}}


def outputs(model: nn.Module, inputs: tuple[torch.Tensor, ...] | dict) -> list[np.ndarray]:
    """The integer model's outputs as numpy arrays (flattened, in output order); ``inputs`` are
    positional, or keyword inputs by name."""
    with torch.no_grad():
        out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    leaves = torch.utils._pytree.tree_flatten(out)[0]
    return [
        (v.dequantize() if isinstance(v, fxq.QTensor) else v).numpy()
        for v in leaves
        if isinstance(v, (torch.Tensor, fxq.QTensor))
    ]


def assert_equal_outputs(expected: list[np.ndarray], got: list[np.ndarray]) -> None:
    assert len(expected) == len(got)
    for e, g in zip(expected, got):
        assert e.dtype == g.dtype and e.shape == g.shape, (e.dtype, g.dtype, e.shape, g.shape)
        assert np.array_equal(e, g), f"max difference {np.abs(e.astype(float) - g).max()}"


def graph_arrays(inputs: tuple | dict, graph: Any) -> list[np.ndarray]:
    """``inputs`` (positional, or keyword by input name) as ``graph.run``'s numpy arguments."""
    if isinstance(inputs, dict):
        return [inputs[name].numpy() for name in graph.inputs]
    return [t.numpy() for t in inputs]


def assert_exact_in_runtimes(integer: nn.Module, graph: Any, onnx_model: Any, inputs) -> None:
    """The numpy runtime (``graph.run``) and onnxruntime (``onnx_model``) reproduce the integer
    model's outputs on ``inputs`` (a tuple, or a dict of keyword inputs) bit for bit."""
    expected = outputs(integer, inputs)
    assert_equal_outputs(expected, graph.run(*graph_arrays(inputs, graph)))
    tensors = tuple(torch.from_numpy(a) for a in graph_arrays(inputs, graph))
    assert_equal_outputs(expected, run_onnx(onnx_model, tensors))


def run_onnx(model: Any, inputs: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
    """Run an ONNX model with onnxruntime's CPU provider."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run(None, {n: t.numpy() for n, t in zip(names, inputs)})


def lsb_difference(graph: Any, model: Any, integer: nn.Module, x: tuple) -> list[np.ndarray]:
    """|ONNX - integer model| in units of each output's scale (1 for float outputs)."""
    got = run_onnx(model, x)
    producers = {o: n for n in graph.nodes for o in n.outputs}
    diffs = []
    for name, e, g in zip(graph.outputs, outputs(integer, x), got):
        node = producers.get(name)
        scale = graph.tensors[name].scale
        if scale is None and node is not None and node.op == "dequantize":
            scale = node.attrs["scale"]
        diffs.append(np.abs(e.astype(np.float64) - g) / (scale or 1.0))
    return diffs
