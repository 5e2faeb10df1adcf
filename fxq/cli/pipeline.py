"""``fxq quantize`` as functions: load, prepare, calibrate (``ptq``, mixed precision),
convert, measure, export; outputs are written to temporary files and renamed only when
every step has succeeded."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fxq
from fxq.cli.config import CliError, QuantizeConfig, config_to_qconfig_dict
from fxq.cli.loading import data_error, load_data, load_model
from fxq.cli.outputs import AtomicOutputs

__all__ = [
    "Steps",
    "QuantizeResult",
    "quantize",
    "evaluate",
    "output_metrics",
]


class Steps:
    """Times each step. Only when stderr is a terminal (and not ``quiet``): a spinner while
    a step that draws no progress bar of its own runs, and a line when each step ends."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.tty = sys.stderr.isatty() and not quiet
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def step(self, name: str, spinner: bool = True) -> Iterator[None]:
        start = time.perf_counter()
        status = contextlib.nullcontext()
        if self.tty and spinner:
            from rich.console import Console

            status = Console(stderr=True).status(f"{name}...")
        with status:
            yield
        self.times[name] = time.perf_counter() - start
        if self.tty:
            print(f"  {name:<20} {self.times[name]:7.1f} s", file=sys.stderr)


@dataclass
class QuantizeResult:
    """What ``quantize`` made: the models, the qconfig_dict used, and measurements."""

    float_model: nn.Module
    calibrated: nn.Module
    integer: nn.Module
    qconfig_dict: dict[str, Any]
    batches: list[Any]
    int16: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def with_input_stubs(model: nn.Module, scale: float) -> torch.fx.GraphModule:
    """The model traced, with a ``fxq.QuantStub(scale)`` on each input (``quant`` for a
    single input, ``quant_<input>`` for several): the model input's scale is fixed."""
    gm = fxq.symbolic_trace(model)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for ph in placeholders:
        name = "quant" if len(placeholders) == 1 else f"quant_{ph.name}"
        gm.add_submodule(name, fxq.QuantStub(scale=scale))
        with gm.graph.inserting_after(ph):
            stub = gm.graph.call_module(name, (ph,))
        ph.replace_all_uses_with(stub, delete_user_cb=lambda user, stub=stub: user is not stub)
    gm.recompile()
    return gm


def model_outputs(model: nn.Module, batches: list[Any], data: str | None = None) -> list[Any]:
    """``model``'s outputs on ``batches``; with ``data`` (the spec the batches were read
    from), a batch the model fails on raises ``fxq.cli.loading.data_error``: the data, how it
    was read, the model's error and the layout the data needs."""
    from fxq.calibration import batch_arguments

    outs = []
    with torch.no_grad():
        for i, batch in enumerate(batches):
            try:
                args, kwargs = batch_arguments(model, batch)
                outs.append(model(*args, **kwargs))
            except Exception as e:
                if data is None:
                    raise
                raise data_error(data, batches, i, e) from e
    return outs


def output_metrics(reference: list[Any], test: list[Any]) -> dict[str, float]:
    """SQNR (dB), cosine and, for classifier logits (one 2-d output with several
    columns), top-1 agreement of ``test`` against ``reference`` (lists of batch outputs)."""
    from fxq.debug.metrics import cosine, flat, sqnr

    ref = torch.cat([flat(r) for r in reference])
    out = torch.cat([flat(t) for t in test])
    result = {"sqnr_db": sqnr(ref, out), "cosine": cosine(ref, out)}
    first = reference[0]
    if isinstance(first, torch.Tensor) and first.dim() == 2 and first.shape[1] > 1:
        agree = sum(
            int((r.argmax(1) == torch.as_tensor(t).argmax(1)).sum())
            for r, t in zip(reference, test)
        )
        result["top1_agreement"] = agree / sum(len(r) for r in reference)
    return result


def evaluate(
    float_model: nn.Module,
    integer: nn.Module,
    batches: list[Any],
    reference: list[Any] | None = None,
) -> dict[str, float]:
    """``output_metrics`` of the integer model against the float model on ``batches``
    (``reference``: the float model's outputs, when already computed)."""
    if reference is None:
        reference = model_outputs(float_model, batches)
    return output_metrics(reference, model_outputs(integer, batches))


def example_inputs(model: nn.Module, batches: list[Any]) -> tuple[torch.Tensor, ...]:
    """Two samples of the first batch (export traces with a batch of 2 or more)."""
    from fxq.calibration import batch_arguments

    args, kwargs = batch_arguments(model, batches[0])
    if kwargs:
        raise CliError("the command line exports models called with positional inputs only")
    return tuple(a[:2] if len(a) >= 2 else torch.cat([a, a]) for a in args)


def _ptq(model: nn.Module, cfg: QuantizeConfig, batches: list[Any], quiet: bool) -> None:
    from fxq.calibration import ptq

    options = {"iters": cfg.iters} if cfg.iters is not None and cfg.method != "calibrate" else {}
    ptq(model, batches, method=cfg.method, show_progress=False if quiet else None, **options)


def _chosen(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    old = before.get("module_name") or {}
    return [k for k in (after.get("module_name") or {}) if k not in old]


def quantize(cfg: QuantizeConfig, steps: Steps | None = None) -> QuantizeResult:
    """Run the ``fxq quantize`` pipeline on a validated config (no files written).

    Returns:
        the models and the integer model's metrics against float on the calibration data.

    Raises:
        CliError: missing MODEL / DATA, what loading them raises, data the float model
            fails on (``model_outputs``).
        ValueError and the other errors of the steps (prepare, ptq, convert).
    """
    steps = steps or Steps(quiet=True)
    if cfg.model is None:
        raise CliError("no MODEL: give it on the command line or as 'model' in the config")
    if cfg.calib is None:
        raise CliError("no calibration data: give --calib DATA or 'calib' in the config")
    fxq.set_march(cfg.march)
    with steps.step("load model"):
        model = load_model(cfg.model, cfg.weights, cfg.model_kwargs)
        if cfg.input_scale is not None:
            model = with_input_stubs(model, cfg.input_scale)
    with steps.step("load data"):
        batches = load_data(
            cfg.calib, cfg.batch_size, cfg.image_size, cfg.mean, cfg.std, cfg.num_batches
        )
    with steps.step("float model"):  # data the model cannot run fails here, named
        reference = model_outputs(model, batches, cfg.calib)  # checks the data fits
    qconfig_dict = config_to_qconfig_dict(cfg.qconfig)
    with steps.step("prepare"):
        calib = fxq.prepare_qat_fx(model, qconfig_dict)
    with steps.step("ptq", spinner=False):
        _ptq(calib, cfg, batches, steps.quiet)
    int16: list[str] = []
    if cfg.int16_budget > 0:
        from fxq.calibration import mixed_precision

        with steps.step("mixed precision"):
            chosen = mixed_precision(
                model, calib, batches, int16_budget=cfg.int16_budget, qconfig_dict=qconfig_dict
            )
            int16 = _chosen(qconfig_dict, chosen)
            qconfig_dict = chosen
            calib = fxq.prepare_qat_fx(model, qconfig_dict)
        with steps.step("ptq (int16)", spinner=False):
            _ptq(calib, cfg, batches, steps.quiet)
    fxq.set_fake_quantize(calib, fxq.FakeQuantState.VALIDATION)
    with steps.step("convert"):
        integer = fxq.convert_fx(calib)
    with steps.step("evaluate"):
        metrics = evaluate(model, integer, batches, reference)
    if cfg.yuv is not None:
        mean = [255.0 * m for m in cfg.mean]
        std = [255.0 * s for s in cfg.std]
        fxq.deploy.yuv_input(
            integer, "quant", swing=cfg.yuv.swing, mean=mean, std=std, bgr=cfg.yuv.bgr
        )
    return QuantizeResult(model, calib, integer, qconfig_dict, batches, int16, metrics)


def _linked(html: str, folder: str) -> str:
    """``report.html``'s relative links pointed into ``folder``."""
    return re.sub(r'href="(?![a-z]+:|#|/)', f'href="{folder}/', html)


def write_outputs(
    cfg: QuantizeConfig, result: QuantizeResult, outputs: AtomicOutputs, steps: Steps
) -> dict[str, str]:
    """Export what the config asks for into temporary files of ``outputs`` (renamed by its
    ``commit``); returns ``{what: final path}``."""
    files: dict[str, str] = {}
    if not (cfg.out or cfg.onnx or cfg.qdq_onnx or cfg.report):
        return files
    example = example_inputs(result.integer, result.batches)
    if cfg.yuv is not None:  # centered YUV integers, not normalised RGB
        example = tuple(torch.randint(-128, 128, e.shape).float() for e in example)
    if cfg.out:
        final = Path(cfg.out)
        with steps.step("export .fxq"):
            fxq.export.to_graph(result.integer, example).save(outputs.file(final))
        files["fxq"] = str(final)
    for key, mode in (("onnx", "integer"), ("qdq_onnx", "qdq")):
        path = getattr(cfg, key)
        if path:
            final = Path(path)
            with steps.step(f"export {mode} onnx"):
                fxq.export.to_onnx(result.integer, example, outputs.file(final), mode=mode)
            files[key] = str(final)
    if cfg.report:
        final = Path(cfg.report)
        folder = final.with_name(final.stem + "_files")
        with steps.step("report"):
            tmp = outputs.folder(folder)
            analysis = fxq.debug.QuantAnalysis(result.float_model, result.calibrated, out_dir=tmp)
            with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
                analysis.auto_find_bad_case(result.batches)  # its tables go to files
                analysis.run()
            html = (tmp / "report.html").read_text(encoding="utf-8")
            outputs.file(final).write_text(_linked(html, folder.name), encoding="utf-8")
        files["report"] = str(final)
    return files
