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
import inspect
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxq.dtypes import QDType, as_qdtype, qint8, qint16, qint32
from fxq.fake_quantize import FakeQuantize, FakeQuantizeFactory
from fxq.march import MarchSpec
from fxq.observer import ObserverBase, get_observer_class
from fxq.registry import canonical_key, row_named, rows

__all__ = [
    "QConfig",
    "get_default_qconfig",
    "default_calib_8bit_fake_quant_qconfig",
    "default_qat_8bit_fake_quant_qconfig",
    "default_calib_8bit_weight_16bit_act_fake_quant_qconfig",
    "default_qat_8bit_weight_16bit_act_fake_quant_qconfig",
    "default_qat_8bit_fixed_act_fake_quant_qconfig",
    "default_qat_8bit_weight_16bit_fixed_act_fake_quant_qconfig",
    "default_calib_8bit_weight_32bit_out_fake_quant_qconfig",
    "default_qat_8bit_weight_32bit_out_fake_quant_qconfig",
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

# How fxq quantizes, said in the vocabulary of torch.ao and the vendor plugin.
_WEIGHT_LAYOUT = (
    "fxq weights are symmetric per output channel (qscheme=torch.per_channel_symmetric, ch_axis=0)"
)
_ACTIVATION_LAYOUT = (
    "fxq activations are symmetric per tensor (qscheme=torch.per_tensor_symmetric): "
    "the zero point is always 0"
)
# FakeQuantize's own arguments; every other qkwargs entry goes to the observer.
_FAKE_QUANT_KWARGS = frozenset({"dtype", "scale", "march"})


def get_default_qconfig(
    activation_fake_quant: str | None = "fake_quant",
    weight_fake_quant: str = "fake_quant",
    activation_observer: str | None = "min_max",
    weight_observer: str = "min_max",
    activation_qkwargs: Mapping[str, Any] | None = None,
    weight_qkwargs: Mapping[str, Any] | None = None,
) -> QConfig:
    """Build a QConfig from names, accepting the vendor plugin's and torch.ao's forms.

    Args:
        activation_fake_quant: ``"fake_quant"``, or ``None`` for a
            high-precision output: the op keeps its int32 accumulator (dtype
            ``fxq.qint32``, like ``default_qat_8bit_weight_32bit_out_fake_quant_qconfig``).
        weight_fake_quant: ``"fake_quant"``.
        activation_observer: an observer name (``"min_max"``,
            ``"moving_average"``, ``"fixed_scale"``, ``"percentile"``, ``"mse"``,
            ``"kl"``, ``"mix"``); ``None`` only with ``activation_fake_quant=None``.
        weight_observer: the same for weights (``"min_max"`` or ``"mse"``).
        activation_qkwargs: ``FakeQuantize`` and observer arguments for
            activations: ``{"dtype": fxq.qint16}``, ``{"averaging_constant":
            0.01}``, ``{"percentile": 99.9}``... ``averaging_constant`` turns
            ``"min_max"`` into ``"moving_average"`` (what the vendor's min/max
            observer does with it), and ``averaging_constant=0`` freezes the
            activation scales: a QAT model that loaded a calibrated
            ``state_dict`` keeps the calibrated scales. ``qscheme=
            torch.per_tensor_symmetric``, ``ch_axis=None`` and
            ``quant_min`` / ``quant_max`` equal to the dtype's range are
            accepted (they say what fxq does anyway).
        weight_qkwargs: the same for weights; ``qscheme=
            torch.per_channel_symmetric`` and ``ch_axis=0`` are accepted.

    Returns:
        the QConfig (its factories build fake quants at ``prepare_qat_fx``).

    Raises:
        ValueError: for an unknown name; a qscheme, ``ch_axis`` or range fxq
            does not quantize with (weights are symmetric int8 per output
            channel, activations symmetric per tensor, zero point 0); a
            non-int8 weight; ``weight_fake_quant=None``; or an argument that
            neither ``FakeQuantize`` nor the observer takes.
    """
    if weight_fake_quant is None:
        raise ValueError(
            "weight_fake_quant=None (float weights) is not available: fxq weights are int8 on "
            "every march. To keep a layer in float, give it a qconfig of None in the qconfig_dict."
        )
    wt_cls = _lookup(_FAKE_QUANTS, weight_fake_quant, "weight_fake_quant")
    wkw = _quant_kwargs(weight_qkwargs, "weight_qkwargs", per_channel=True)
    if wkw["dtype"] is not qint8:
        raise ValueError(
            f"weights are int8 on every march; weight_qkwargs asked for {wkw['dtype']!r}"
        )
    w_obs = _observer_for(weight_observer, wkw, "weight_qkwargs", per_channel=True)
    wt = FakeQuantizeFactory(wt_cls, observer=w_obs, ch_axis=0, **wkw)
    return QConfig(
        activation=_activation_factory(
            activation_fake_quant, activation_observer, activation_qkwargs
        ),
        weight=wt,
    )


def _activation_factory(
    fake_quant: str | None, observer: str | None, qkwargs: Mapping[str, Any] | None
) -> FakeQuantizeFactory:
    if fake_quant is None:  # the vendor's form of a high-precision (int32) output
        extra = dict(qkwargs or {})
        if extra and (set(extra) != {"dtype"} or as_qdtype(extra["dtype"]) is not qint32):
            raise ValueError(
                "activation_fake_quant=None asks for an int32 (high-precision) output, which has "
                f"no fake quant, so activation_qkwargs={extra!r} cannot apply; remove them, or "
                "name a fake quant (activation_fake_quant='fake_quant') to quantize the output"
            )
        obs = get_observer_class(observer or "min_max", False)  # never used by an int32 output
        return FakeQuantizeFactory(FakeQuantize, observer=obs, dtype=qint32)
    cls = _lookup(_FAKE_QUANTS, fake_quant, "activation_fake_quant")
    if observer is None:
        raise ValueError(
            "activation_observer=None is only meaningful with activation_fake_quant=None (an "
            "int32 output); name an observer such as 'min_max' or 'moving_average'"
        )
    akw = _quant_kwargs(qkwargs, "activation_qkwargs", per_channel=False)
    return FakeQuantizeFactory(
        cls, observer=_observer_for(observer, akw, "activation_qkwargs", per_channel=False), **akw
    )


def _quant_kwargs(qkwargs: Mapping[str, Any] | None, what: str, per_channel: bool) -> dict:
    """Check and drop the layout arguments (qscheme, ch_axis, quant_min/max) fxq fixes itself."""
    if qkwargs is None:
        qkwargs = {}
    if not isinstance(qkwargs, Mapping):
        raise ValueError(f"{what} must be a dict, got {type(qkwargs).__name__}")
    kw = dict(qkwargs)
    layout = _WEIGHT_LAYOUT if per_channel else _ACTIVATION_LAYOUT
    want_qscheme = torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric
    if "qscheme" in kw:
        qscheme = kw.pop("qscheme")
        if qscheme != want_qscheme:
            raise ValueError(
                f"{what}: qscheme={qscheme} is not available: {layout}. "
                f"Remove 'qscheme' or pass qscheme={want_qscheme}."
            )
    if "ch_axis" in kw:
        axis = kw.pop("ch_axis")
        want_axis = 0 if per_channel else None
        if axis != want_axis:
            fix = "Remove 'ch_axis' or pass ch_axis=0." if per_channel else "Remove 'ch_axis'."
            raise ValueError(f"{what}: ch_axis={axis!r} is not available: {layout}. {fix}")
    if "observer" in kw:
        raise ValueError(
            f"{what}: choose the observer by name with the "
            f"{'weight' if per_channel else 'activation'}_observer argument, not an 'observer' "
            "entry"
        )
    dtype = kw["dtype"] = as_qdtype(kw.get("dtype", qint8))
    for key, bound in (("quant_min", dtype.qmin), ("quant_max", dtype.qmax)):
        if key in kw and kw.pop(key) != bound:
            raise ValueError(
                f"{what}: {key}={qkwargs[key]!r} is not the range of {dtype.name} "
                f"[{dtype.qmin}, {dtype.qmax}]; fxq always uses the whole range of the dtype: "
                f"remove {key!r} or choose the dtype with 'dtype'"
            )
    return kw


def _observer_for(
    name: str, kw: Mapping[str, Any], what: str, per_channel: bool
) -> type[ObserverBase]:
    """The observer class for ``name``, after checking that it takes the arguments in ``kw``."""
    if name == "min_max" and "averaging_constant" in kw:
        name = "moving_average"  # the vendor's min/max observer is a moving average
    cls = get_observer_class(name, per_channel)
    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return cls
    accepted = (set(params) - {"ch_axis", "num_channels"}) | _FAKE_QUANT_KWARGS
    unknown = sorted(set(kw) - accepted)
    if unknown:
        raise ValueError(
            f"{what}: {', '.join(map(repr, unknown))} is not an argument of FakeQuantize or of "
            f"the {name!r} observer ({cls.__name__}); accepted: {', '.join(sorted(accepted))}"
        )
    return cls


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
# QAT with the activation scales frozen: load a calibrated state_dict, then only weights train.
default_qat_8bit_fixed_act_fake_quant_qconfig = get_default_qconfig(
    activation_qkwargs={"averaging_constant": 0}
)
default_qat_8bit_weight_16bit_fixed_act_fake_quant_qconfig = get_default_qconfig(
    activation_qkwargs={"dtype": qint16, "averaging_constant": 0}
)
# High-precision output: the conv / linear keeps its int32 accumulator. One qconfig serves
# calibration and QAT (as in the vendor plugin, whose names these are).
default_qat_8bit_weight_32bit_out_fake_quant_qconfig = get_default_qconfig(
    activation_fake_quant=None, activation_observer=None
)
default_calib_8bit_weight_32bit_out_fake_quant_qconfig = (
    default_qat_8bit_weight_32bit_out_fake_quant_qconfig
)
# Earlier names of the same qconfig, kept as aliases.
default_calib_out_8bit_fake_quant_qconfig = default_calib_8bit_weight_32bit_out_fake_quant_qconfig
default_qat_out_8bit_fake_quant_qconfig = default_qat_8bit_weight_32bit_out_fake_quant_qconfig


# -- functional op aliases ----------------------------------------------------
# One canonical key per functional op (the op registry's row name), so that `torch.add`,
# `operator.add`, `x.add(...)` and `x += y` are configured together.
canonical_op = canonical_key


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
                if isinstance(t, str):
                    t = _type_key_from_string(key, t, model)
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
            self._warn_if_unmatched(compiled)
        # qconfig attributes set on modules
        self.attributes: dict[str, QConfig | None] = {}
        for name, module in self._modules.items():
            if "qconfig" in module.__dict__:
                where = f"attribute {name or '<root>'}.qconfig"
                self.attributes[name] = self._check(where, module.__dict__["qconfig"], "attribute")

    def _warn_if_unmatched(self, pattern: re.Pattern[str]) -> None:
        """Warn for a ``module_name_regex`` that matches no module's whole name (it selects
        nothing; a name it matches in part is the usual cause)."""
        names = [n for n in self._modules if n]
        if any(pattern.fullmatch(n) for n in names):
            return
        partly = [n for n in names if pattern.search(n)]
        hint = (
            f"; it matches part of {partly[0]!r}, and must match a whole name "
            f"(e.g. {'.*' + pattern.pattern + '.*'!r})"
            if partly
            else ""
        )
        warnings.warn(
            f"qconfig_dict['module_name_regex']: {pattern.pattern!r} matches no module of the "
            f"model, so it selects nothing{hint}",
            UserWarning,
            stacklevel=4,
        )

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


# -- module_type keys given as strings ----------------------------------------------
_NN_PREFIXES = ("torch.nn.", "nn.")


def _nn_module_classes() -> dict[str, type[nn.Module]]:
    """Every module class ``torch.nn`` exports, by name."""
    return {
        name: obj
        for name, obj in vars(nn).items()
        if isinstance(obj, type) and issubclass(obj, nn.Module)
    }


def _functional_op_names() -> list[str]:
    """The strings that name a functional op: registry row names and ``Tensor`` method names."""
    names: list[str] = []
    for row in rows():
        if row.functions or row.methods:
            names.append(row.name)
            names.extend(row.methods)
    return names


def _functional_op_key(name: str) -> str | None:
    """The qconfig key of the functional op ``name`` names (``"add_"`` gives ``"add"``), or None."""
    key = canonical_op(name)
    try:
        row = row_named(key)
    except KeyError:
        return None
    return key if (row.functions or row.methods) else None


def _type_key_from_string(where: str, name: str, model: nn.Module) -> Any:
    """Resolve a ``module_type`` key written as a string.

    ``"Conv2d"``, ``"nn.Conv2d"`` and ``"torch.nn.Conv2d"`` give the class
    ``torch.nn.Conv2d``; a functional op's name (``"add"``, ``"cat"``,
    ``"matmul"``, a ``Tensor`` method such as ``"add_"``) gives its key.

    Raises:
        ValueError: for any other string, with close matches, the class form,
            and the class of ``model`` that has that name if there is one.
    """
    op = _functional_op_key(name)
    if op is not None:
        return op
    classes = _nn_module_classes()
    prefix = next((p for p in _NN_PREFIXES if name.startswith(p)), "")
    short = name[len(prefix) :]
    if short in classes:
        return classes[short]
    # close matches: classes for "nn.Xxx", classes and op names otherwise
    candidates: dict[str, list[str]] = {}
    for candidate in dict.fromkeys([*([] if prefix else _functional_op_names()), *classes]):
        candidates.setdefault(candidate.lower(), []).append(candidate)
    close = difflib.get_close_matches(short.lower(), list(candidates), n=3)
    close = [c for lowered in close for c in candidates[lowered]]
    hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
    own = next((type(m) for m in model.modules() if type(m).__name__ == short), None)
    if own is not None:
        hint += (
            f" The model has a module class named {short!r} "
            f"({own.__module__}.{own.__qualname__}): pass that class itself."
        )
    raise ValueError(
        f"qconfig_dict[{where!r}]: the key {name!r} matches no torch.nn module class and no "
        f"functional op, so it would configure nothing.{hint} Use the class or function itself "
        "(e.g. {torch.nn.Conv2d: qconfig}, {MyBlock: qconfig}, {torch.add: qconfig}); strings "
        "may name a torch.nn class ('Conv2d', 'nn.Conv2d', 'torch.nn.Conv2d') or a functional "
        "op ('add', 'cat', 'matmul', ...)."
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
