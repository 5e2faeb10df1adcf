"""Accuracy debugging: which layer loses accuracy, and why.

The tools keep the vendor plugin's names (``horizon_plugin_pytorch.utils``) so
its users find them where they expect:

* ``featuremap_similarity``: two versions of a model (float, calibrated, QAT,
  integer) layer by layer, with each layer's own error separated from what it
  inherited;
* ``get_raw_features`` + ``profile_featuremap``: activation statistics, clipping
  and underflow per layer;
* ``compare_weights``: per-channel weight quantization error;
* ``sensitivity``: the model-output error when only one value is quantized;
* ``QuantAnalysis``: all of it on the inputs where the models disagree most;
* ``compare_qat_quantized`` / ``float_fake_quant``: the QAT model against its
  integer model.

Each returns its rows; with ``out_dir`` it also writes text tables and one
self-contained HTML page (matplotlib, imported only then).
"""

from fxq.debug.analysis import QuantAnalysis
from fxq.debug.compare import compare_qat_quantized, float_fake_quant
from fxq.debug.sensitivity import sensitivity
from fxq.debug.similarity import featuremap_similarity
from fxq.debug.statistics import get_raw_features, profile_featuremap
from fxq.debug.weights import compare_weights

__all__ = [
    "featuremap_similarity",
    "compare_weights",
    "get_raw_features",
    "profile_featuremap",
    "sensitivity",
    "QuantAnalysis",
    "compare_qat_quantized",
    "float_fake_quant",
]
