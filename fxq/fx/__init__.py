"""Graph passes: tracing, fusion, prepare (and convert)."""

from fxq.fx.convert import convert_fx
from fxq.fx.fuse import fuse_fx
from fxq.fx.prepare import prepare_qat_fx
from fxq.fx.tracer import FxqTraceError, Tracer, fx_wrap, symbolic_trace

__all__ = [
    "convert_fx",
    "fuse_fx",
    "prepare_qat_fx",
    "symbolic_trace",
    "fx_wrap",
    "Tracer",
    "FxqTraceError",
]
