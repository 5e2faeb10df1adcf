"""The ``fxq quantize`` config file: a pydantic schema, YAML / TOML loading with line
numbers in errors, and the conversion to and from the Python API's ``qconfig_dict``.

A config holds what the flags hold (``model``, ``calib``, ``march``, ...; the flag
``--int16-budget`` is the key ``int16_budget``) and the per-layer settings::

    model: torchvision.models:mobilenet_v2
    weights: mobilenet_v2.pth          # relative paths are relative to this file
    calib: images/
    image_size: 224
    march: bayes
    int16_budget: 0.1
    input_scale: 0.0078125             # a fixed scale for the model input
    qconfig:
      global: int8
      module_type: {Sigmoid: int16, add: int16}
      module_name: {classifier: float, features.0: {dtype: int16, observer: percentile,
                                                     params: {percentile: 99.9}}}
      module_name_regex: {'features\\.1[0-9]\\..*': int16}

A qconfig is ``int8``, ``int16``, ``int32`` (a conv / linear output kept at its
int32 accumulator), ``float`` (left in float), or a mapping ``{dtype, observer,
weight_observer, scale, params}`` (``fxq.qconfig.get_default_qconfig``'s
arguments: the activation observer by name, its arguments in ``params``, a fixed
activation ``scale``).
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fxq.cli.errors import CliError
from fxq.utils.sample_data import IMAGENET_MEAN, IMAGENET_STD

__all__ = [
    "CliError",
    "QuantizeConfig",
    "LayerConfig",
    "QConfigSpec",
    "YuvConfig",
    "load_config",
    "validate_config",
    "config_to_qconfig_dict",
    "qconfig_dict_to_config",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
]

#: the short forms of a qconfig
QCONFIG_NAMES = ("int8", "int16", "int32", "float")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class QConfigSpec(_Strict):
    """One qconfig written out: ``get_default_qconfig``'s arguments by name."""

    dtype: Literal["int8", "int16", "int32", "float"] = "int8"
    observer: str | None = None
    weight_observer: str = "min_max"
    scale: float | None = Field(None, gt=0)
    params: dict[str, float | int | bool | str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _buildable(self) -> QConfigSpec:
        if self.dtype == "float" and self != QConfigSpec(dtype="float"):
            raise ValueError("a float qconfig (left in float) takes no other setting")
        if self.dtype == "int32" and (self.observer or self.scale or self.params):
            raise ValueError("an int32 output has no activation observer, scale or params")
        build_qconfig(self)  # unknown observers and arguments fail here, with the location
        return self


QConfigValue = Literal["int8", "int16", "int32", "float"] | QConfigSpec


class LayerConfig(_Strict):
    """Per-layer qconfigs, as in a ``qconfig_dict`` (priority: module_name >
    module_name_regex > module_type > global)."""

    global_: QConfigValue = Field("int8", alias="global")
    module_type: dict[str, QConfigValue] = Field(default_factory=dict)
    module_name: dict[str, QConfigValue] = Field(default_factory=dict)
    module_name_regex: dict[str, QConfigValue] = Field(default_factory=dict)

    @field_validator("module_name_regex")
    @classmethod
    def _regexes_compile(cls, value: dict[str, Any]) -> dict[str, Any]:
        for pattern in value:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"bad regex {pattern!r}: {e}") from None
        return value

    def to_yaml_data(self) -> dict[str, Any]:
        """Plain data for ``yaml.safe_dump`` (the inverse of validating it)."""
        return self.model_dump(by_alias=True, exclude_defaults=False, exclude_none=True)


class YuvConfig(_Strict):
    """Camera input: the integer model takes centered YUV444 (``fxq.deploy.yuv_input``)."""

    swing: Literal["studio", "full"] = "full"
    bgr: bool = False


class QuantizeConfig(_Strict):
    """Everything ``fxq quantize`` needs; each flag is the key of the same name."""

    model: str | None = None
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    weights: str | None = None
    calib: str | None = None
    march: Literal["bernoulli2", "bayes", "bayes-e"] = "bayes"
    method: Literal["default", "best", "calibrate"] = "default"
    iters: int | None = Field(None, ge=0)
    int16_budget: float = Field(0.0, ge=0, le=1)
    num_batches: int | None = Field(None, ge=1)
    batch_size: int = Field(8, ge=1)
    image_size: int = Field(224, ge=1)
    mean: list[float] = Field(default_factory=lambda: list(IMAGENET_MEAN))
    std: list[float] = Field(default_factory=lambda: list(IMAGENET_STD))
    input_scale: float | None = Field(None, gt=0)
    yuv: YuvConfig | None = None
    out: str | None = None
    onnx: str | None = None
    qdq_onnx: str | None = None
    report: str | None = None
    qconfig: LayerConfig = Field(default_factory=LayerConfig)

    @field_validator("mean", "std")
    @classmethod
    def _three_or_one(cls, value: list[float]) -> list[float]:
        if len(value) not in (1, 3):
            raise ValueError(f"give 1 or 3 values, got {len(value)}")
        return value

    @field_validator("std")
    @classmethod
    def _positive(cls, value: list[float]) -> list[float]:
        if any(v <= 0 for v in value):
            raise ValueError("every std must be positive")
        return value


#: keys that are paths: relative ones in a config file are relative to the file's folder
PATH_KEYS = ("weights", "calib", "out", "onnx", "qdq_onnx", "report")


# -- qconfigs ---------------------------------------------------------------------------
def build_qconfig(spec: str | QConfigSpec) -> Any:
    """The ``fxq.qconfig.QConfig`` (or None for ``float``) a config value stands for.

    Raises:
        ValueError: an observer name or argument ``get_default_qconfig`` refuses.
    """
    import fxq.calibration  # noqa: F401  (registers the calibration observers by name)
    from fxq.dtypes import qint8, qint16
    from fxq.qconfig import get_default_qconfig

    if isinstance(spec, str):
        spec = QConfigSpec.model_construct(
            dtype=spec, observer=None, weight_observer="min_max", scale=None, params={}
        )
    if spec.dtype == "float":
        return None
    if spec.dtype == "int32":
        return get_default_qconfig(
            activation_fake_quant=None,
            activation_observer=None,
            weight_observer=spec.weight_observer,
        )
    observer = spec.observer or ("fixed_scale" if spec.scale is not None else "min_max")
    qkwargs: dict[str, Any] = {"dtype": qint16 if spec.dtype == "int16" else qint8}
    qkwargs.update(spec.params)
    if spec.scale is not None:
        qkwargs["scale"] = spec.scale
    return get_default_qconfig(
        activation_observer=observer,
        weight_observer=spec.weight_observer,
        activation_qkwargs=qkwargs,
    )


def _observer_name(cls: type, per_channel: bool) -> str:
    from fxq.observer import observer_registry

    for name, pair in observer_registry().items():
        if pair[1 if per_channel else 0] is cls:
            return name
    raise ValueError(f"the observer {cls.__name__} has no registered name, so no config names it")


def qconfig_to_spec(qconfig: Any) -> str | QConfigSpec:
    """The config value of a ``QConfig`` (``None``: ``"float"``); the short form where
    there is one (``"int8"`` is ``get_default_qconfig()``).

    Raises:
        ValueError: a qconfig that ``get_default_qconfig`` cannot build (a fake-quant
            class or observer without a registered name).
    """
    import fxq.calibration  # noqa: F401  (the calibration observers' names)
    from fxq.fake_quantize import FakeQuantize
    from fxq.qconfig import QConfig

    if qconfig is None:
        return "float"
    if not isinstance(qconfig, QConfig):
        raise ValueError(f"expected a fxq QConfig or None, got {type(qconfig).__name__}")
    for factory in (qconfig.activation, qconfig.weight):
        if factory.cls is not FakeQuantize:
            raise ValueError(f"the fake quant {factory.cls.__name__} cannot be written in a config")
    weight = dict(qconfig.weight.keywords)
    weight_observer = _observer_name(weight.pop("observer"), per_channel=True)
    weight.pop("dtype", None), weight.pop("ch_axis", None)
    if weight:
        raise ValueError(f"weight fake-quant arguments {sorted(weight)} cannot be written")
    act = dict(qconfig.activation.keywords)
    dtype = act.pop("dtype").name.replace("q", "", 1)  # qint8 -> int8
    observer = _observer_name(act.pop("observer"), per_channel=False)
    if dtype == "int32":
        spec = QConfigSpec(dtype="int32", weight_observer=weight_observer)
    else:
        scale = act.pop("scale", None)
        if observer == "fixed_scale" and scale is not None:
            observer = None
        spec = QConfigSpec(
            dtype=dtype,
            observer=None if observer == "min_max" else observer,
            weight_observer=weight_observer,
            scale=scale,
            params=act,
        )
    short = QConfigSpec(dtype=spec.dtype)
    return spec.dtype if spec == short else spec


def _type_name(key: Any) -> str:
    """A ``module_type`` key as a config string: ``"Conv2d"`` for torch.nn classes, the
    op's name for functional ops, ``"package.module:Class"`` for other classes."""
    from torch import nn

    from fxq.qconfig import canonical_op

    if isinstance(key, str):
        return canonical_op(key) if isinstance(canonical_op(key), str) else key
    if isinstance(key, type):
        if getattr(nn, key.__name__, None) is key:
            return key.__name__
        return f"{key.__module__}:{key.__qualname__}"
    op = canonical_op(key)
    if isinstance(op, str):
        return op
    raise ValueError(f"the module_type key {key!r} is no class and no known functional op")


def _type_key(name: str) -> Any:
    """The inverse of ``_type_name``: ``"package.module:Class"`` is imported; other
    strings are left for ``prepare_qat_fx`` to resolve (``"Conv2d"``, ``"add"``)."""
    if ":" not in name:
        return name
    from fxq.cli.loading import import_object

    return import_object(name, "module_type key")


def config_to_qconfig_dict(config: LayerConfig | QuantizeConfig | Mapping[str, Any]) -> dict:
    """The ``qconfig_dict`` for ``fxq.prepare_qat_fx`` that a config's ``qconfig`` holds.

    Args:
        config: a ``QuantizeConfig``, its ``qconfig`` part (``LayerConfig``), or the
            mapping a config file holds under ``qconfig:``.

    Returns:
        ``{"": ..., "module_type": {...}, "module_name": {...}, "module_name_regex": [...]}``
        (empty sections left out); ``module_type`` keys stay strings (``"Conv2d"``,
        ``"add"``), which ``prepare_qat_fx`` resolves, except ``"package.module:Class"``,
        which is imported.

    Raises:
        pydantic.ValidationError: a mapping that is not a valid ``qconfig`` section.
        CliError: a ``module_type`` class that cannot be imported.
    """
    if isinstance(config, QuantizeConfig):
        config = config.qconfig
    elif not isinstance(config, LayerConfig):
        config = LayerConfig.model_validate(config)
    out: dict[str, Any] = {"": build_qconfig(config.global_)}
    if config.module_type:
        out["module_type"] = {_type_key(k): build_qconfig(v) for k, v in config.module_type.items()}
    if config.module_name_regex:
        out["module_name_regex"] = [
            (k, build_qconfig(v)) for k, v in config.module_name_regex.items()
        ]
    if config.module_name:
        out["module_name"] = {k: build_qconfig(v) for k, v in config.module_name.items()}
    return out


def qconfig_dict_to_config(qconfig_dict: Mapping[str, Any]) -> LayerConfig:
    """The config ``qconfig`` section for a ``qconfig_dict`` (``config_to_qconfig_dict``'s
    inverse; ``"object_type"`` is read as ``"module_type"``, lists of pairs as mappings).

    Raises:
        ValueError: an unknown key, or a qconfig or type key a config cannot express.
    """
    known = ("", "module_type", "object_type", "module_name", "module_name_regex")
    unknown = [k for k in qconfig_dict if k not in known]
    if unknown:
        raise ValueError(f"qconfig_dict: unknown key {unknown[0]!r}; valid keys: {known}")

    def pairs(key: str) -> list[tuple[Any, Any]]:
        value = qconfig_dict.get(key) or {}
        return list(value.items()) if isinstance(value, Mapping) else [tuple(p) for p in value]

    data: dict[str, Any] = {"global": qconfig_to_spec(qconfig_dict.get(""))}
    types = pairs("object_type") + pairs("module_type")
    if types:
        data["module_type"] = {_type_name(k): qconfig_to_spec(v) for k, v in types}
    for key in ("module_name", "module_name_regex"):
        if pairs(key):
            data[key] = {k: qconfig_to_spec(v) for k, v in pairs(key)}
    return LayerConfig.model_validate(data)


# -- files --------------------------------------------------------------------------------
def _read(path: Path) -> tuple[dict[str, Any], Any]:
    """The file's data and its YAML node tree (None for TOML: no line marks)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CliError(f"config file {path} does not exist") from None
    except OSError as e:
        raise CliError(f"cannot read config file {path}: {e.strerror}") from None
    if path.suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise CliError(f"{path}: TOML configs need Python 3.11 or newer; use YAML") from None

        try:
            return tomllib.loads(text), None
        except tomllib.TOMLDecodeError as e:
            raise CliError(f"{path}: not valid TOML: {e}") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise CliError(f"{path}{line}: not valid YAML: {e.problem or e.context}") from None
    if data is None:
        return {}, node
    if not isinstance(data, dict):
        raise CliError(f"{path}:1: the config must be a mapping of keys, got {type(data).__name__}")
    return data, node


def _line_of(node: Any, loc: tuple[Any, ...]) -> int | None:
    """The 1-based line of the value at ``loc`` in a composed YAML tree (for an unknown
    key, the key's own line); the deepest node found when ``loc`` goes past the file."""
    if node is None:
        return None
    line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.value == str(part):
                    line, node = key.start_mark.line + 1, value
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                return line
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return node.start_mark.line + 1 if not isinstance(node, yaml.MappingNode) else line


def _schema_path(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """The data path of a pydantic error location: union branches dropped
    (``('qconfig', 'global', 'QConfigSpec', 'dtype')`` -> ``('qconfig', 'global', 'dtype')``)."""
    out = []
    for part in loc:
        if isinstance(part, str) and ("QConfigSpec" in part or part.startswith("literal[")):
            continue
        out.append(part)
        if len(out) >= 2 and out[-2] == "params":  # the rest names a union member (float, int...)
            break
    return tuple(out)


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys allowed beside the unknown key at ``loc`` (for "did you mean")."""
    parent = tuple(loc[:-1])
    if parent == ():
        model: type[BaseModel] = QuantizeConfig
    elif parent == ("qconfig",):
        model = LayerConfig
    elif parent == ("yuv",):
        model = YuvConfig
    elif parent[:1] == ("qconfig",):
        model = QConfigSpec
    else:
        return []
    return [f.alias or n for n, f in model.model_fields.items()]


def _message(error: dict[str, Any], loc: tuple[Any, ...]) -> str:
    if error["type"] == "extra_forbidden":
        key = str(loc[-1])
        allowed = _allowed_keys(loc)
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown key {key!r}{hint}"
    msg = error["msg"].removeprefix("Value error, ")
    if error["type"] not in ("value_error", "missing") and "input" in error:
        msg += f", got {error['input']!r}"
    return msg


def _union_branch(loc: tuple[Any, ...]) -> int | None:
    """Where a union branch marker sits in an error location, if anywhere."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and ("QConfigSpec" in part or part.startswith("literal[")):
            return i
    return None


def _best_error(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """One error to report. A qconfig value matches no branch of ``int8 | ... | mapping``:
    the branch of the value's kind (a mapping: what is wrong inside it; else the names)."""
    first = errors[0]
    i = _union_branch(first["loc"])
    if i is None:
        return first
    prefix = first["loc"][:i]
    branches = [e for e in errors if e["loc"][:i] == prefix and _union_branch(e["loc"]) == i]
    literal = next((e for e in branches if "QConfigSpec" not in e["loc"][i]), first)
    if isinstance(literal.get("input"), Mapping):
        inner = [e for e in branches if "QConfigSpec" in e["loc"][i] and e["type"] != "model_type"]
        return inner[0] if inner else first
    return literal


def validate_config(
    data: Mapping[str, Any], source: str | None = None, node: Any = None, flags: Mapping = {}
) -> QuantizeConfig:
    """Validate config data, raising one ``CliError`` that names the key and, for a key
    from a file, ``file:line`` (for a key given as a flag, the flag).

    Args:
        data: the merged config (file values overridden by ``flags``).
        source: the config file's name (for messages).
        node: the file's composed YAML tree (line numbers).
        flags: the keys given as flags, mapped to the flag's spelling.
    """
    try:
        return QuantizeConfig.model_validate(dict(data))
    except ValidationError as e:
        error = _best_error(e.errors())
        loc = _schema_path(error["loc"])
        key = ".".join(str(p) for p in loc) or "<config>"
        if loc and loc[0] in flags:
            raise CliError(f"{flags[loc[0]]}: {_message(error, loc)}") from None
        where = source or "config"
        line = _line_of(node, loc)
        if line is not None:
            where += f":{line}"
        raise CliError(f"{where}: {key}: {_message(error, loc)}") from None


def load_config(path: str | os.PathLike, overrides: Mapping[str, Any] = {}, flags=None) -> Any:
    """Read and validate a config file (``.yaml`` / ``.yml`` / ``.toml``), with ``overrides``
    (flag values) winning over the file's keys.

    Relative paths in the file (``weights``, ``calib``, ``out``, ``onnx``, ``qdq_onnx``,
    ``report``) are taken relative to the file's folder.

    Returns:
        the ``QuantizeConfig``.

    Raises:
        CliError: a missing or unreadable file, bad YAML / TOML, an unknown key or a wrong
            value (naming the key and its line).
    """
    path = Path(path)
    data, node = _read(path)
    for key in ("model", "calib", *PATH_KEYS):
        value = data.get(key)
        if key in overrides or not isinstance(value, str) or os.path.isabs(value):
            continue
        local = path.parent / value
        # MODEL and DATA may be factories (module:function): paths only where they exist
        if key not in ("model", "calib") or ":" not in value or local.exists():
            data[key] = str(local)
    data.update(overrides)
    return validate_config(data, str(path), node, flags or {})
