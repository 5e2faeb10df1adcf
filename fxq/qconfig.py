"""QConfig: how each part of a model is quantized, and how a qconfig_dict resolves.

A ``QConfig`` pairs two fake-quant factories: one for the output activation of
an op, one for its weight. ``None`` instead of a QConfig keeps a region in
float.

qconfig_dict keys, from lowest to highest priority::

    {
        "": qconfig,                                   # global
        "module_type": {nn.Conv2d: qconfig, torch.add: None},   # or a list of pairs
        "module_name_regex": [(r"head\\..*", qconfig)],
        "module_name": {"backbone.layer4": qconfig},   # a prefix covers submodules
    }

and above them all the ``qconfig`` attribute of a module (or of its nearest
ancestor that has one). ``"object_type"`` is accepted as an alias of
``"module_type"``. For functional ops (``+``, ``torch.cat``, ``F.relu``, ...)
the module name is that of the module whose ``forward`` calls them, and the
module type key is the function (``operator.add``, ``torch.add`` and the
``Tensor.add`` method are one op).
"""

from __future__ import annotations

import difflib
import operator
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fxq.dtypes import QDType, qint8, qint16, qint32
from fxq.fake_quantize import FakeQuantize, FakeQuantizeFactory
from fxq.march import MarchSpec
from fxq.observer import get_observer_class

__all__ = [
    "QConfig",
    "get_default_qconfig",
    "default_calib_8bit_fake_quant_qconfig",
    "default_qat_8bit_fake_quant_qconfig",
    "default_calib_8bit_weight_16bit_act_fake_quant_qconfig",
    "default_qat_8bit_weight_16bit_act_fake_quant_qconfig",
    "default_calib_out_8bit_fake_quant_qconfig",
    "default_qat_out_8bit_fake_quant_qconfig",
    "QConfigResolver",
    "QConfigChoice",
    "canonical_op",
]


@dataclass(frozen=True, eq=False)
class QConfig:
    """How to quantize one op.

    Attributes:
        activation: factory of the output fake quant (its dtype is the
            output dtype; ``fxq.qint32`` keeps the int32 accumulator).
        weight: factory of the weight fake quant (per output channel).
    """

    activation: FakeQuantizeFactory
    weight: FakeQuantizeFactory

    def __post_init__(self) -> None:
        for field in ("activation", "weight"):
            value = getattr(self, field)
            if not isinstance(value, FakeQuantizeFactory):
                raise ValueError(
                    f"QConfig.{field} must be a fake-quant factory such as "
                    f"FakeQuantize.with_args(...), got {value!r}"
                )

    @property
    def activation_dtype(self) -> QDType:
        return self.activation.dtype

    @property
    def weight_dtype(self) -> QDType:
        return self.weight.dtype

    def __repr__(self) -> str:
        return f"QConfig(activation={self.activation!r}, weight={self.weight!r})"


_FAKE_QUANTS = {"fake_quant": FakeQuantize}


def get_default_qconfig(
    activation_fake_quant: str = "fake_quant",
    weight_fake_quant: str = "fake_quant",
    activation_observer: str = "min_max",
    weight_observer: str = "min_max",
    activation_qkwargs: dict[str, Any] | None = None,
    weight_qkwargs: dict[str, Any] | None = None,
) -> QConfig:
    """Build a QConfig from names.

    Args:
        activation_fake_quant, weight_fake_quant: ``"fake_quant"``.
        activation_observer: an observer name from ``fxq.observer.OBSERVERS``
            (``"min_max"``, ``"moving_average"``, ``"fixed_scale"``, ...).
        weight_observer: the same for weights (always per output channel).
        activation_qkwargs: extra ``FakeQuantize`` arguments for activations,
            e.g. ``{"dtype": fxq.qint16}`` or ``{"averaging_constant": 0.01}``.
        weight_qkwargs: the same for weights.

    Raises:
        ValueError: for an unknown name, or weight kwargs that ask for a
            non-int8 weight.
    """
    act_cls = _lookup(_FAKE_QUANTS, activation_fake_quant, "activation_fake_quant")
    wt_cls = _lookup(_FAKE_QUANTS, weight_fake_quant, "weight_fake_quant")
    akw = dict(activation_qkwargs or {})
    wkw = dict(weight_qkwargs or {})
    akw.setdefault("dtype", qint8)
    wkw.setdefault("dtype", qint8)
    if wkw["dtype"] not in (qint8, "qint8", torch.int8):
        raise ValueError(
            f"weights are int8 on every march; weight_qkwargs asked for {wkw['dtype']!r}"
        )
    act = FakeQuantizeFactory(
        act_cls, observer=get_observer_class(activation_observer, False), **akw
    )
    wt = FakeQuantizeFactory(
        wt_cls, observer=get_observer_class(weight_observer, True), ch_axis=0, **wkw
    )
    return QConfig(activation=act, weight=wt)


def _lookup(table: Mapping[str, Any], name: str, what: str) -> Any:
    try:
        return table[name]
    except KeyError:
        raise ValueError(
            f"unknown {what} {name!r}; choose from {', '.join(sorted(table))}"
        ) from None


default_calib_8bit_fake_quant_qconfig = get_default_qconfig(activation_observer="min_max")
default_qat_8bit_fake_quant_qconfig = get_default_qconfig(
    activation_observer="moving_average", activation_qkwargs={"averaging_constant": 0.01}
)
default_calib_8bit_weight_16bit_act_fake_quant_qconfig = get_default_qconfig(
    activation_observer="min_max", activation_qkwargs={"dtype": qint16}
)
default_qat_8bit_weight_16bit_act_fake_quant_qconfig = get_default_qconfig(
    activation_observer="moving_average",
    activation_qkwargs={"dtype": qint16, "averaging_constant": 0.01},
)
# High-precision final output: the conv / linear keeps its int32 accumulator.
default_calib_out_8bit_fake_quant_qconfig = get_default_qconfig(
    activation_qkwargs={"dtype": qint32}
)
default_qat_out_8bit_fake_quant_qconfig = get_default_qconfig(activation_qkwargs={"dtype": qint32})


# -- functional op aliases ----------------------------------------------------
# One canonical key per functional op, so that `torch.add`, `operator.add`,
# `x.add(...)` and `x += y` are configured together.
_ALIASES: dict[Any, str] = {}


def _alias(name: str, *targets: Any) -> None:
    for t in targets:
        _ALIASES[t] = name


_alias("add", operator.add, operator.iadd, torch.add, "add", "add_")
_alias("sub", operator.sub, operator.isub, torch.sub, "sub", "sub_")
_alias("mul", operator.mul, operator.imul, torch.mul, "mul", "mul_")
_alias("matmul", operator.matmul, torch.matmul, torch.bmm, "matmul", "bmm")
_alias("cat", torch.cat, torch.concat)
_alias("relu", F.relu, torch.relu, "relu", "relu_")
_alias("relu6", F.relu6)
_alias("interpolate", F.interpolate)
_alias("mean", torch.mean, "mean")
_alias("sum", torch.sum, "sum")
_alias("sigmoid", torch.sigmoid, F.sigmoid, "sigmoid")
_alias("tanh", torch.tanh, F.tanh, "tanh")
_alias("flatten", torch.flatten, "flatten")


def canonical_op(target: Any) -> Any:
    """The canonical qconfig key of a functional op target (itself if unaliased)."""
    try:
        return _ALIASES.get(target, target)
    except TypeError:  # unhashable target
        return target


# -- resolution -----------------------------------------------------------------
_VALID_KEYS = ("", "module_type", "object_type", "module_name", "module_name_regex")


@dataclass(frozen=True)
class QConfigChoice:
    """A resolved qconfig and where it came from (for summaries and errors)."""

    qconfig: QConfig | None
    source: (
        str  # "attribute", "module_name", "module_name_regex", "module_type", "global", "default"
    )
    key: str  # the matched key, human readable


class QConfigResolver:
    """Validates a qconfig_dict and answers "which qconfig for this op?".

    Args:
        qconfig_dict: the user's dict (may be None).
        model: the float model; its modules' ``qconfig`` attributes count.
        spec: the march every qconfig must be runnable on.

    Raises:
        ValueError: for unknown keys, wrong value types, module names that
            match nothing, bad regexes, or dtypes the march cannot run.
    """

    def __init__(self, qconfig_dict: Mapping[str, Any] | None, model: nn.Module, spec: MarchSpec):
        self.spec = spec
        self.model = model
        self._modules = dict(model.named_modules())
        qconfig_dict = {} if qconfig_dict is None else qconfig_dict
        if not isinstance(qconfig_dict, Mapping):
            raise ValueError(f"qconfig_dict must be a dict, got {type(qconfig_dict).__name__}")
        for key in qconfig_dict:
            if key not in _VALID_KEYS:
                hint = difflib.get_close_matches(str(key), _VALID_KEYS[1:], n=1)
                raise ValueError(
                    f"qconfig_dict: unknown key {key!r}"
                    + (f" (did you mean {hint[0]!r}?)" if hint else "")
                    + "; valid keys are "
                    + ", ".join(repr(k) for k in _VALID_KEYS)
                )
        self.global_qconfig = self._check("the global qconfig ('')", qconfig_dict.get(""), "global")
        self.has_global = "" in qconfig_dict
        types: dict[Any, QConfig | None] = {}
        for key in ("object_type", "module_type"):
            for t, qc in self._pairs(qconfig_dict, key):
                if not (isinstance(t, type) or callable(t) or isinstance(t, str)):
                    raise ValueError(
                        f"qconfig_dict[{key!r}]: keys must be module classes or functions, got {t!r}"
                    )
                types[canonical_op(t)] = self._check(f"{key} {_name_of(t)}", qc, key)
        self.types = types
        self.names: dict[str, QConfig | None] = {}
        for name, qc in self._pairs(qconfig_dict, "module_name"):
            if not isinstance(name, str):
                raise ValueError(f"qconfig_dict['module_name']: keys must be strings, got {name!r}")
            if name not in self._modules:
                close = difflib.get_close_matches(name, list(self._modules), n=3)
                raise ValueError(
                    f"qconfig_dict['module_name']: no module named {name!r} in the model"
                    + (f"; close names: {', '.join(close)}" if close else "")
                )
            self.names[name] = self._check(f"module_name {name!r}", qc, "module_name")
        self.regexes: list[tuple[re.Pattern[str], QConfig | None]] = []
        for pattern, qc in self._pairs(qconfig_dict, "module_name_regex"):
            if not isinstance(pattern, str):
                raise ValueError(
                    f"qconfig_dict['module_name_regex']: keys must be regex strings, got {pattern!r}"
                )
            try:
                compiled = re.compile(pattern)
            except re.error as e:
                raise ValueError(
                    f"qconfig_dict['module_name_regex']: bad regex {pattern!r}: {e}"
                ) from None
            self.regexes.append(
                (compiled, self._check(f"module_name_regex {pattern!r}", qc, "module_name_regex"))
            )
        # qconfig attributes set on modules
        self.attributes: dict[str, QConfig | None] = {}
        for name, module in self._modules.items():
            if "qconfig" in module.__dict__:
                where = f"attribute {name or '<root>'}.qconfig"
                self.attributes[name] = self._check(where, module.__dict__["qconfig"], "attribute")

    @staticmethod
    def _pairs(d: Mapping[str, Any], key: str) -> Iterable[tuple[Any, Any]]:
        value = d.get(key)
        if value is None:
            return []
        if isinstance(value, Mapping):
            return list(value.items())
        if isinstance(value, (list, tuple)):
            pairs = []
            for item in value:
                if not (isinstance(item, (list, tuple)) and len(item) == 2):
                    raise ValueError(
                        f"qconfig_dict[{key!r}] must be a dict or a list of (key, qconfig) pairs; "
                        f"found the item {item!r}"
                    )
                pairs.append(tuple(item))
            return pairs
        raise ValueError(
            f"qconfig_dict[{key!r}] must be a dict or a list of (key, qconfig) pairs, "
            f"got {type(value).__name__}"
        )

    def _check(self, where: str, qc: Any, source: str) -> QConfig | None:
        if qc is None:
            return None
        if not isinstance(qc, QConfig):
            raise ValueError(
                f"qconfig_dict: the value for {where} must be a fxq QConfig or None, "
                f"got {type(qc).__name__} ({qc!r})"
            )
        dt = qc.activation_dtype
        if dt is qint32:
            if not self.spec.high_precision_output:
                raise ValueError(
                    f"qconfig for {where} asks for an int32 (high precision) output, which march "
                    f"{self.spec.march.value} cannot produce"
                )
        elif not self.spec.supports_activation(dt):
            raise ValueError(
                f"qconfig for {where} uses activation dtype {dt.name}, which march "
                f"{self.spec.march.value} cannot run (it runs: {self.spec.allowed_dtype_names()}). "
                "Use an 8-bit activation qconfig or choose a march that has "
                f"{dt.name} (e.g. fxq.set_march('bayes'))."
            )
        if qc.weight_dtype is not self.spec.weight_dtype:
            raise ValueError(
                f"qconfig for {where} uses weight dtype {qc.weight_dtype.name}; march "
                f"{self.spec.march.value} weights are {self.spec.weight_dtype.name}"
            )
        return qc

    # -- queries -----------------------------------------------------------
    def resolve(self, module_path: str, type_key: Any) -> QConfigChoice:
        """The qconfig for an op owned by ``module_path``.

        Args:
            module_path: dotted path of the module (for a call_module) or of
                the module whose forward calls the functional op ("" = root).
            type_key: the module class, or the functional target.
        """
        # 1. qconfig attribute on the module or its nearest ancestor
        path = module_path
        while True:
            if path in self.attributes:
                return QConfigChoice(
                    self.attributes[path], "attribute", f"{path or '<root>'}.qconfig"
                )
            if not path:
                break
            path = path.rpartition(".")[0]
        # 2. module_name: the longest matching prefix
        path = module_path
        while True:
            if path in self.names:
                return QConfigChoice(self.names[path], "module_name", path)
            if not path:
                break
            path = path.rpartition(".")[0]
        # 3. module_name_regex: first full match
        for pattern, qc in self.regexes:
            if pattern.fullmatch(module_path):
                return QConfigChoice(qc, "module_name_regex", pattern.pattern)
        # 4. module_type
        key = canonical_op(type_key)
        try:
            if key in self.types:
                return QConfigChoice(self.types[key], "module_type", _name_of(type_key))
        except TypeError:
            pass
        if isinstance(type_key, type):
            for t, qc in self.types.items():
                if isinstance(t, type) and issubclass(type_key, t):
                    return QConfigChoice(qc, "module_type", _name_of(t))
        # 5. global
        if self.has_global:
            return QConfigChoice(self.global_qconfig, "global", "''")
        return QConfigChoice(None, "default", "no qconfig")

    def anything_quantized(self) -> bool:
        return (
            self.global_qconfig is not None
            or any(v is not None for v in self.types.values())
            or any(v is not None for v in self.names.values())
            or any(v is not None for _, v in self.regexes)
            or any(v is not None for v in self.attributes.values())
        )


def _name_of(t: Any) -> str:
    if isinstance(t, str):
        return t
    mod = getattr(t, "__module__", "") or ""
    name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or repr(t)
    if mod in ("_operator", "operator"):
        return f"operator.{name}"
    if mod.startswith("torch") and not isinstance(t, type):
        return f"{mod}.{name}".replace("torch._C._nn", "torch.nn.functional")
    return name
