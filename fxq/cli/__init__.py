"""The ``fxq`` command line (``fxq ...`` or ``python -m fxq ...``).

* ``fxq quantize MODEL --calib DATA [--config cfg.yaml] --out model.fxq --onnx model.onnx``:
  trace, prepare, ``ptq`` (and ``mixed_precision`` with ``--int16-budget``), convert,
  measure against float, export, and the debug report;
* ``fxq run model.fxq input.npy [--out out.npy]``: run a saved integer graph (numpy);
* ``fxq summary model.fxq``: the graph's node table;
* ``fxq compare MODEL model.fxq --calib DATA``: float against integer (SQNR, cosine, top-1).

Errors print one line on stderr (``fxq: error: ...``) and exit with code 2, leaving no
output file behind; ``--debug`` anywhere on the line shows the traceback instead.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from fxq.cli.config import (
    CliError,
    QuantizeConfig,
    config_to_qconfig_dict,
    load_config,
    qconfig_dict_to_config,
    validate_config,
)
from fxq.cli.errors import error_text

__all__ = [
    "main",
    "config_to_qconfig_dict",
    "qconfig_dict_to_config",
    "load_config",
    "QuantizeConfig",
    "CliError",
]

#: click parameter name -> the flag (config keys are the parameter names)
QUANTIZE_FLAGS = {
    "model": "MODEL",
    "calib": "--calib",
    "march": "--march",
    "method": "--method",
    "iters": "--iters",
    "int16_budget": "--int16-budget",
    "out": "--out",
    "onnx": "--onnx",
    "qdq_onnx": "--qdq-onnx",
    "report": "--report",
    "num_batches": "--num-batches",
    "batch_size": "--batch-size",
    "image_size": "--image-size",
    "mean": "--mean",
    "std": "--std",
    "weights": "--weights",
    "model_kwargs": "--model-kwargs",
    "input_scale": "--input-scale",
}


def _floats(text: str | None, flag: str) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise CliError(
            f"{flag}: expected numbers such as 0.485,0.456,0.406, got {text!r}"
        ) from None


def _echo(text: str = "") -> None:
    click.echo(text)


def _fmt(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.2f}"


def _metrics_line(metrics: dict[str, float]) -> str:
    line = f"SQNR {_fmt(metrics['sqnr_db'])} dB, cosine {metrics['cosine']:.5f}"
    if "top1_agreement" in metrics:
        line += f", top-1 agreement {100 * metrics['top1_agreement']:.1f} %"
    return line


def _json_safe(metrics: dict[str, float]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in metrics.items()}


#: ``--debug`` is taken off the command line by ``main`` (it works anywhere on it); the
#: option is here so that every ``--help`` lists it
_debug_option = click.option(
    "--debug", is_flag=True, expose_value=False, help="on an error, show the traceback"
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fxq", prog_name="fxq")
@_debug_option
def cli() -> None:
    """fxq: quantize PyTorch (and ONNX) models for integer accelerators."""


_DATA_HELP = "a folder of images, a .npy / .npz of inputs, or package.module:function"


@cli.command()
@click.argument("model", required=False)
@click.option("--calib", metavar="DATA", help=f"calibration data: {_DATA_HELP}")
@click.option("--config", "config_path", metavar="FILE", help="a YAML or TOML config; flags win")
@click.option("--march", type=click.Choice(["bernoulli2", "bayes", "bayes-e"]))
@click.option(
    "--method",
    type=click.Choice(["default", "best", "calibrate"]),
    help="ptq recipe: default; best (also tries percentile ranges); calibrate (the "
    "observers alone, no learned rounding: fastest)",
)
@click.option("--iters", type=int, help="learned-rounding steps per block (0: none)")
@click.option("--int16-budget", type=float, help="fraction of activations raised to int16")
@click.option("--out", metavar="FILE.fxq", help="the integer graph (fxq.export)")
@click.option("--onnx", metavar="FILE.onnx", help="integer ONNX (bit-exact in onnxruntime)")
@click.option("--qdq-onnx", metavar="FILE.onnx", help="QDQ ONNX for other compilers")
@click.option("--report", metavar="FILE.html", help="debug report (linked pages in FILE_files/)")
@click.option("--num-batches", type=int, help="use only the first N batches")
@click.option("--batch-size", type=int, help="samples per batch (images, arrays)")
@click.option("--image-size", type=int, help="images: shorter side resized, centre-cropped")
@click.option("--mean", help="images: normalisation mean, e.g. 0.485,0.456,0.406")
@click.option("--std", help="images: normalisation std, e.g. 0.229,0.224,0.225")
@click.option(
    "--weights", metavar="FILE", help="a state dict loaded into the MODEL factory's model"
)
@click.option(
    "--model-kwargs", metavar="JSON", help="factory arguments, e.g. '{\"num_classes\": 10}'"
)
@click.option("--input-scale", type=float, help="a fixed scale for the model input")
@click.option("--quiet", "-q", is_flag=True, help="no progress or step lines")
@click.option("--json", "as_json", is_flag=True, help="print the results as one JSON object")
@_debug_option
def quantize(config_path: str | None, quiet: bool, as_json: bool, **flags: Any) -> None:
    """Quantize MODEL with calibration DATA and write the integer model.

    MODEL is package.module:function (e.g. torchvision.models:mobilenet_v2) or a .onnx file.
    """
    from fxq.cli.loading import parse_json_kwargs
    from fxq.cli.outputs import AtomicOutputs
    from fxq.cli.pipeline import Steps, write_outputs
    from fxq.cli.pipeline import quantize as run_quantize

    if quiet:
        warnings.simplefilter("ignore")  # e.g. FloatOpWarning: --quiet prints only results
    flags["mean"] = _floats(flags["mean"], "--mean")
    flags["std"] = _floats(flags["std"], "--std")
    flags["model_kwargs"] = parse_json_kwargs(flags["model_kwargs"], "--model-kwargs") or None
    given = {k: v for k, v in flags.items() if v is not None}
    names = {k: QUANTIZE_FLAGS[k] for k in given}
    if config_path is not None:
        cfg = load_config(config_path, given, names)
    else:
        cfg = validate_config(given, flags=names)
    with AtomicOutputs() as outputs:
        for key in ("out", "onnx", "qdq_onnx", "report"):
            if getattr(cfg, key):
                outputs.check(getattr(cfg, key), QUANTIZE_FLAGS[key])
        steps = Steps(quiet=quiet or as_json)
        if steps.tty:
            click.echo(
                f"fxq quantize {cfg.model} (march {cfg.march}, method {cfg.method})", err=True
            )
        result = run_quantize(cfg, steps)
        files = write_outputs(cfg, result, outputs, steps)
        outputs.commit()
    if as_json:
        report = {
            "model": cfg.model,
            "march": cfg.march,
            "method": cfg.method,
            "samples": sum(
                len(b[0] if isinstance(b, (tuple, list)) else b) for b in result.batches
            ),
            "metrics": _json_safe(result.metrics),
            "int16": result.int16,
            "files": files,
            "seconds": {k: round(v, 3) for k, v in steps.times.items()},
        }
        click.echo(json.dumps(report))
        return
    _echo(f"integer vs float on the calibration data: {_metrics_line(result.metrics)}")
    if result.int16:
        _echo(f"int16 activations ({len(result.int16)}): {', '.join(result.int16)}")
    for path in files.values():
        _echo(f"wrote {path}")
    times = ", ".join(f"{k} {v:.1f} s" for k, v in steps.times.items())
    _echo(f"time: {sum(steps.times.values()):.1f} s ({times})")


def _load_graph(path: str) -> Any:
    from fxq.export import load

    if not Path(path).is_file():
        raise CliError(f"integer graph {path} does not exist")
    try:
        return load(path)
    except (OSError, ValueError, KeyError) as e:
        raise CliError(f"cannot read integer graph {path}: {e}") from None


def _read_inputs(paths: Sequence[str], count: int) -> list[Any]:
    import numpy as np

    arrays = []
    for p in paths:
        if not Path(p).is_file():
            raise CliError(f"input file {p} does not exist")
        try:
            loaded = np.load(p, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise CliError(f"cannot read input {p}: {e}") from None
        arrays += [loaded[k] for k in loaded.files] if p.endswith(".npz") else [loaded]
    if len(arrays) != count:
        raise CliError(f"the graph takes {count} input(s), got {len(arrays)}")
    return arrays


@cli.command()
@click.argument("graph", metavar="MODEL.fxq")
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT.npy...")
@click.option(
    "--out",
    metavar="FILE",
    help="save the output in FILE.npy (FILE.npz: every output, by name; needed for several)",
)
@_debug_option
def run(graph: str, inputs: tuple[str, ...], out: str | None) -> None:
    """Run a saved integer graph on .npy / .npz inputs with fxq's numpy runtime."""
    import numpy as np

    from fxq.cli.outputs import AtomicOutputs

    g = _load_graph(graph)
    if out is not None:
        AtomicOutputs.check(out, "--out")
        if not out.endswith((".npy", ".npz")):
            raise CliError(
                f"--out {out}: give a .npy file (one output) or .npz (the outputs by name)"
            )
        if len(g.outputs) > 1 and not out.endswith(".npz"):
            raise CliError(f"--out {out}: the graph has {len(g.outputs)} outputs; give a .npz file")
    from fxq.export import GraphInputError

    try:
        results = g.run(*_read_inputs(inputs, len(g.inputs)))
    except GraphInputError as e:
        files = ", ".join(inputs)
        raise CliError(f"input {files} does not fit the integer graph {graph}: {e}") from None
    for name, y in zip(g.outputs, results):
        line = f"{name}: {y.dtype}[{'x'.join(map(str, y.shape))}]"
        if y.size:
            line += f" min {y.min():.6g} max {y.max():.6g}"
        if y.ndim == 2 and y.shape[1] > 1:
            line += f" argmax {y.argmax(1).tolist()}"
        _echo(line)
    if out is not None:
        with AtomicOutputs() as outputs:
            tmp = outputs.file(Path(out))
            with open(tmp, "wb") as f:
                if out.endswith(".npz"):
                    np.savez(f, **dict(zip(g.outputs, results)))
                else:
                    np.save(f, results[0], allow_pickle=False)
            outputs.commit()
        _echo(f"wrote {out}")


@cli.command()
@click.argument("graph", metavar="MODEL.fxq")
@_debug_option
def summary(graph: str) -> None:
    """Print the node table of a saved integer graph."""
    _load_graph(graph).print_tabular()


@cli.command()
@click.argument("model")
@click.argument("graph", metavar="MODEL.fxq")
@click.option("--calib", required=True, metavar="DATA", help=f"inputs: {_DATA_HELP}")
@click.option(
    "--weights", metavar="FILE", help="a state dict loaded into the MODEL factory's model"
)
@click.option("--model-kwargs", metavar="JSON", help="factory arguments as a JSON object")
@click.option("--num-batches", type=int, help="use only the first N batches")
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--image-size", type=int, default=224, show_default=True)
@click.option("--mean", help="images: normalisation mean (default ImageNet's)")
@click.option("--std", help="images: normalisation std (default ImageNet's)")
@click.option("--json", "as_json", is_flag=True, help="print the metrics as JSON")
@_debug_option
def compare(model: str, graph: str, calib: str, weights: str | None, **options: Any) -> None:
    """Compare the float MODEL with a saved integer graph on DATA (SQNR, cosine, top-1)."""
    import torch

    from fxq.calibration import batch_arguments
    from fxq.cli.config import IMAGENET_MEAN, IMAGENET_STD
    from fxq.cli.loading import describe_batches, load_data, load_model, parse_json_kwargs
    from fxq.cli.pipeline import model_outputs, output_metrics
    from fxq.export import GraphInputError

    g = _load_graph(graph)
    float_model = load_model(
        model, weights, parse_json_kwargs(options["model_kwargs"], "--model-kwargs")
    )
    mean = _floats(options["mean"], "--mean") or list(IMAGENET_MEAN)
    std = _floats(options["std"], "--std") or list(IMAGENET_STD)
    batches = load_data(
        calib, options["batch_size"], options["image_size"], mean, std, options["num_batches"]
    )
    reference = model_outputs(float_model, batches, calib)
    integer = []
    for batch in batches:
        args, _ = batch_arguments(float_model, batch)
        try:
            outs = g.run(*[a.numpy() for a in args])
        except GraphInputError as e:
            raise CliError(
                f"calibration data {calib}, read as {describe_batches(batches)}, does not fit "
                f"the integer graph {graph}: {e}"
            ) from None
        integer.append(
            torch.from_numpy(outs[0]) if len(outs) == 1 else [torch.from_numpy(o) for o in outs]
        )
    metrics = output_metrics(reference, integer)
    if options["as_json"]:
        _echo(json.dumps(_json_safe(metrics)))
    else:
        _echo(f"integer graph vs float model: {_metrics_line(metrics)}")


def _one_line(error: BaseException) -> str:
    if isinstance(error, click.ClickException):
        text = " ".join(str(error).split())
        return text.removesuffix(".") if isinstance(error, click.UsageError) else text
    return error_text(error)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``fxq`` console script. Returns (and, run as a script, exits with) 0 on success,
    2 on any error (one line on stderr; ``--debug`` anywhere shows the traceback)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    try:
        cli.main(args, prog_name="fxq", standalone_mode=False)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("fxq: aborted", err=True)
        return 2
    except click.ClickException as e:
        if debug:
            raise
        hint = ""
        if isinstance(e, click.UsageError) and e.ctx is not None:
            hint = f" (see '{e.ctx.command_path} --help')"
        click.echo(f"fxq: error: {_one_line(e)}{hint}", err=True)
        return 2
    except Exception as e:
        if debug:
            raise
        click.echo(f"fxq: error: {_one_line(e)}", err=True)
        return 2
    return 0
