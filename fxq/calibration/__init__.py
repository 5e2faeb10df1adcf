"""Post-training calibration.

* observers by name: ``get_default_qconfig(activation_observer="percentile" |
  "mse" | "kl" | "mix")`` and ``weight_observer="mse"`` (``fxq.calibration.observers``);
* ``calibrate(model, data)``: run calibration batches (progress bar, ``num_batches``,
  tuple / dict batches);
* ``auto_calibrate(model, data)``: per layer, the observer that minimises the
  model's final output error;
* ``weight_reconstruction(model, data)``: learned weight rounding (AdaRound-style)
  and bias correction.
"""

from fxq.calibration.auto import auto_calibrate
from fxq.calibration.reconstruction import weight_reconstruction
from fxq.calibration.runner import batch_arguments, calibrate

__all__ = ["calibrate", "auto_calibrate", "weight_reconstruction", "batch_arguments"]
