"""fxq: PyTorch FX graph-mode quantization for integer neural-network accelerators.

The pipeline::

    fxq.set_march("bayes")
    qat = fxq.prepare_qat_fx(model, {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig})
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)   # calibrate
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.QAT)           # fine-tune
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)    # evaluate

On a machine without torch, fxq is only the integer-graph runtime: ``fxq.export``
loads and runs saved graphs with numpy (``python -m fxq.export.run graph.fxq x.npy``);
every other name raises an ``ImportError`` that says so.
"""

import importlib.util

__version__ = "0.1.0"

if importlib.util.find_spec("torch") is not None:
    from fxq import calibration, debug, deploy, export, functional, qconfig, registry
    from fxq.dtypes import QDType, qint8, qint16, qint32
    from fxq.fake_quantize import FakeQuantize, FakeQuantState, set_fake_quantize
    from fxq.fx import FxqTraceError, convert_fx, fuse_fx, fx_wrap, prepare_qat_fx, symbolic_trace
    from fxq.fx.prepare import FloatOpWarning
    from fxq.march import March, get_march, get_march_spec, set_march
    from fxq.qtensor import QTensor
    from fxq.stubs import DeQuantStub, QuantStub
    from fxq.summary import summary

    __all__ = [
        "March",
        "set_march",
        "get_march",
        "get_march_spec",
        "fx_wrap",
        "symbolic_trace",
        "fuse_fx",
        "prepare_qat_fx",
        "convert_fx",
        "QTensor",
        "set_fake_quantize",
        "FakeQuantState",
        "FakeQuantize",
        "QuantStub",
        "DeQuantStub",
        "QDType",
        "qint8",
        "qint16",
        "qint32",
        "qconfig",
        "functional",
        "deploy",
        "summary",
        "FxqTraceError",
        "FloatOpWarning",
        "registry",
        "calibration",
        "export",
        "debug",
    ]
else:  # numpy only: the integer-graph runtime
    from fxq import export

    __all__ = ["export"]

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(
            f"fxq.{name} needs torch, which is not installed; without torch fxq only loads and "
            "runs exported integer graphs (fxq.export.load, python -m fxq.export.run)"
        )
