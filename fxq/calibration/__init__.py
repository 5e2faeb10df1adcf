"""Post-training calibration.

* observers by name: ``get_default_qconfig(activation_observer="percentile" |
  "mse" | "kl" | "mix")`` and ``weight_observer="mse"`` (``fxq.calibration.observers``,
  registered with ``fxq.observer.register_observer`` when this package is imported);
* ``calibrate(model, data)``: run calibration batches (progress bar, ``num_batches``,
  tuple / dict batches);
* ``auto_calibrate(model, data)``: per layer, the observer that minimises the
  model's final output error;
* ``weight_reconstruction(model, data)``: learned weight rounding (AdaRound-style)
  and bias correction;
* ``bias_correction(model, data)``: each layer's mean output matched to the
  float model's (layer by layer, or NNCF's fast form);
* ``ptq(model, data, method="default" | "best")``: the post-training recipes
  in one call (wide model outputs, per-sample mean ranges, depthwise-input
  equalization, a short learned rounding; ``"best"`` chooses between two range
  settings and learns longer);
* ``mixed_precision(float_model, calib_model, data, int16_budget=0.1)``: a
  qconfig_dict giving int16 (or float) to the most sensitive activations;
* ``offset_activations(model)``: ReLU outputs read by convolutions and linear
  layers quantized onto all of int8's levels, stored shifted (``ptq`` does it);
* ``tune_biases(model, data, float_model)``: the biases trained end to end on
  the model output (``ptq(..., tune_biases=True)``).

Every ``data`` follows one contract (``fxq.calibration.data``): an iterable of
batches, a batch being a tensor, a tuple whose first elements are the inputs
(``(images, labels)``) or a dict of keyword inputs; ``input_fn`` maps anything else.

Only the observers are imported with the package; the runners (which use the
QAT modules and the FX passes) are imported on first use (PEP 562), so that
``import fxq.calibration.observers`` stays in the observers' layer.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from fxq.calibration import observers as observers  # registers percentile / mse / kl / mix

__all__ = [
    "calibrate",
    "auto_calibrate",
    "weight_reconstruction",
    "bias_correction",
    "batch_arguments",
    "ptq",
    "mixed_precision",
    "offset_activations",
    "tune_biases",
]

# public name -> the submodule that defines it
_LAZY = {
    "calibrate": "fxq.calibration.runner",
    "batch_arguments": "fxq.calibration.runner",
    "auto_calibrate": "fxq.calibration.auto",
    "weight_reconstruction": "fxq.calibration.reconstruction",
    "bias_correction": "fxq.calibration.bias_correction",
    "ptq": "fxq.calibration.ptq",
    "mixed_precision": "fxq.calibration.mixed_precision",
    "offset_activations": "fxq.calibration.offset",
    "tune_biases": "fxq.calibration.bias_tuning",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fxq.calibration' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """Keeps ``fxq.calibration.ptq`` (and the other functions named like their
    submodule) the function: importing the submodule sets the package's attribute
    of that name to the submodule, after which ``from fxq.calibration import ptq``
    gave the module."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
