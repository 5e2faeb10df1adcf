"""``mixed_precision``: int16 (or float) for the activations where it helps the output most.

``fxq.debug.sensitivity(..., dtype=fxq.qint16)`` measures, for every
activation of a calibrated model, the model-output SQNR when only that
activation is raised to int16 (its range kept, its step 256 times finer).
``mixed_precision`` ranks the activations by it and returns a qconfig_dict
that gives int16 to the best ones within a budget, and optionally leaves the
ones whose quantization costs most in float (``float_budget``, for hybrid
deployment where the accelerator hands some ops to the CPU).

Budgets are fractions of the model's quantized activations, **counted as
tensors** (fake quants; ``budget_unit="tensors"``, the default):
``int16_budget=0.1`` on a model with 60 quantized activations raises at most 6
of them. With ``budget_unit="bytes"`` they are fractions of the activations'
elements, measured on the first batch: the int16 ones hold at most that share
of the values the quantized activations hold, so the activation memory and
traffic grow by at most that share. An early, large feature map costs more
than a late, small one, so activations are then taken in order of the output
noise each removes per element, skipping what no longer fits (MobileNetV2,
then ``best``: 10 % of the bytes 22.03 dB; 33 % of the bytes, what the 10 %
tensor budget's five early maps hold, 24.01 dB against their 22.15 dB). A
budget of 0 changes nothing (the returned dict then prepares the same model
as before).

A functional op's output (a residual ``x + y``, a ``F.gelu``, an attention call)
has no module of the float model to name: its fake quant lives in a module that
``prepare_qat_fx`` created (``block.add``). It is chosen through the module
whose ``forward`` calls it (its owner): a ``module_name_regex`` entry that
matches exactly the owner's path, which reaches the ops that forward calls
itself and none of its submodules (``module_name`` would reach those too). All
quantized ops of one owner move together and are paid for together; an owner
is only chosen where every op it calls took the global qconfig (no other entry
of ``qconfig_dict`` reaches them), and never the root.

When learned rounding follows (``ptq(method="best")``), rank with
``float_weights=True`` on a model calibrated without learned rounding
(``ptq(model, data, iters=0)``: a learned rounding is written back into the
float weights, and ``float_weights`` refuses such a model): the rounding takes away most of the weights' error,
so what int16 should go to is the activations' error alone (MobileNetV2,
10 % int16 then ``best``: 22.07 dB ranked on the quantized weights, 22.43 dB
ranked with float weights; docs/accuracy_log.md). The benchmark ranks on the
signed grid (``ptq(model, data, iters=0, offset=False)``), then learns with
``ptq(method="best", float_activations=True, iters=120, lr=0.1,
tune_biases=8)``: 25.09 dB on MobileNetV2 with 10 % int16, where plain
``best`` gives 23.21 dB (``docs/accuracy_log.md``, fourteenth and fifteenth sessions).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from fxq.calibration.data import batch_arguments, one_or_more_batches
from fxq.dtypes import qint16
from fxq.fake_quantize import bypassed, weight_quants
from fxq.march import spec_for
from fxq.observer import world_size
from fxq.qat.base import QATModule
from fxq.qconfig import QConfig
from fxq.utils.warning_summary import summarises_warnings

__all__ = ["mixed_precision", "BUDGET_UNITS", "RANKINGS"]

#: how ``mixed_precision``'s budgets count the activations
BUDGET_UNITS = ("tensors", "bytes")
#: how ``mixed_precision`` ranks the int16 candidates
RANKINGS = ("raise_one", "quantize_one")


def _as_raised(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``quantize_one`` rows (each activation alone at int8) as ``raise_one`` rows: the
    all-int8 output noise taken as the sum of each activation's own, and raising one as
    removing its share (int16's own noise, 256 times finer, neglected). Best first."""
    noise = {r["name"]: 10 ** (-r["sqnr"] / 10) if math.isfinite(r["sqnr"]) else 0.0 for r in rows}
    total = sum(noise.values())
    if total <= 0:
        return [{**r, "baseline": math.inf, "sqnr": math.inf} for r in rows]
    baseline = -10 * math.log10(total)
    raised = [
        {**r, "baseline": baseline, "sqnr": -10 * math.log10(max(total - noise[r["name"]], 1e-300))}
        for r in rows
    ]
    return sorted(raised, key=lambda r: r["sqnr"], reverse=True)


def _int16_qconfig(qconfig: QConfig) -> QConfig:
    return QConfig(activation=qconfig.activation.with_args(dtype=qint16), weight=qconfig.weight)


def _common_qconfig(calib_model: nn.Module) -> QConfig | None:
    """The qconfig most QAT modules of ``calib_model`` were prepared with."""
    counts: dict[int, tuple[int, QConfig]] = {}
    for m in calib_model.modules():
        if isinstance(m, QATModule) and isinstance(getattr(m, "qconfig", None), QConfig):
            n, _ = counts.get(id(m.qconfig), (0, m.qconfig))
            counts[id(m.qconfig)] = (n + 1, m.qconfig)
    return max(counts.values(), key=lambda c: c[0])[1] if counts else None


def _weights_on_their_grid(model: nn.Module) -> bool:
    """Whether every weighted layer's folded weight is a multiple of its scale (within
    float error): the mark of learned rounding written back."""
    from fxq.calibration.reconstruction import _learned_layers

    layers = _learned_layers(model)  # the layers learned rounding learns
    if not layers:
        return False
    with torch.no_grad():
        for layer in layers:
            w = layer.folded_weight()
            ratio = w / layer.weight_fake_quant.scale.reshape([-1] + [1] * (w.dim() - 1))
            if float((ratio - ratio.round()).abs().max()) > 1e-3:
                return False
    return True


def _check_budget(name: str, value: float | None) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"mixed_precision: {name} must be a fraction in [0, 1], got {value!r}")
    return float(value)


@summarises_warnings("fxq.calibration.mixed_precision")
def mixed_precision(
    float_model: nn.Module,
    calib_model: GraphModule,
    batches: Any,
    int16_budget: float = 0.1,
    float_budget: float | None = None,
    qconfig_dict: Mapping[str, Any] | None = None,
    min_gain_db: float = 0.0,
    float_weights: bool = False,
    budget_unit: str = "tensors",
    show: bool = False,
    input_fn: Callable[[Any], Any] | None = None,
    ranking: str = "raise_one",
    output_fn: Callable[[Any], Any] | None = None,
) -> dict[str, Any]:
    """A qconfig_dict with int16 activations (and float ops) where they help the output most.

    Args:
        float_model: the float model (the reference of the sensitivity).
        calib_model: the same model prepared with ``qconfig_dict`` and calibrated
            (e.g. with ``fxq.calibration.ptq``); left as it was.
        batches: calibration batches for the sensitivity (a list; a few suffice), as
            ``fxq.debug.sensitivity`` takes them (``fxq.calibration.data``).
        int16_budget: the largest fraction of the quantized activations (counted
            as ``budget_unit`` says) that are int16 in the model the result prepares:
            those ``calib_model`` has int16 already (a model output that ``ptq``
            widened, an int16 qconfig) are counted first.
        float_budget: the largest fraction left in float (a qconfig of None):
            those whose quantization costs the model output most (sensitivity
            in ``"float_one"`` mode; per element under ``budget_unit="bytes"``).
            They are chosen first; int16 goes to the rest.
        qconfig_dict: the dict ``calib_model`` was prepared with; the result is
            a copy of it with ``module_name`` entries added. Without it, the
            global qconfig is the one most of ``calib_model``'s ops use.
        min_gain_db: raise an activation only when int16 gains at least this
            much output SQNR over the all-int8 model.
        float_weights: measure the sensitivity with the weights unrounded
            (their fake quants bypassed): the ranking for a model whose
            weight rounding is learned afterwards. ``calib_model`` must not
            have learned its rounding already (``ptq(..., iters=0)``).
        budget_unit: ``"tensors"``: the budgets count activations as tensors;
            ``"bytes"``: as their elements on the first batch of ``batches``
            (the share of the int8 activation bytes that widens; an activation
            already int16 counts its elements, not its bytes, one that the
            first batch does not reach is not chosen, and a sum the march keeps on
            chip, ``FakeQuantize.on_chip_with``, is not counted).
        show: print the choices.
        input_fn: maps a batch to the models' arguments.
        ranking: how the int16 candidates are ranked. ``"raise_one"``: the model-output
            SQNR with all activations int8 but this one int16 (``sensitivity(...,
            dtype=qint16)``). ``"quantize_one"``: the output noise each activation causes
            alone at int8, everything else float (``sensitivity(..., mode="quantize_one")``),
            taken as what raising it removes from the all-int8 noise, the noises adding up.
            Where the error comes from many tensors at once (a transformer's residual
            stream), no single raise shows over the others' noise and ``"raise_one"`` ranks
            nearly blind; ``"quantize_one"`` sees each tensor's own share, and is about half
            as long (no int8 baseline per value). See ``docs/transformers.md``.
        output_fn: maps a model's output to the part the ranking compares (as
            ``fxq.debug.sensitivity`` takes it), e.g.
            ``lambda out: out["last_hidden_state"]``: a Hugging Face encoder's last
            hidden state, not its pooler output, when the pooler is not what the model is
            used for.

    Returns:
        a qconfig_dict for ``prepare_qat_fx(float_model, ...)``; its
        ``"module_name"`` entries name the chosen modules (also readable from
        ``result["module_name"]``), its ``"module_name_regex"`` entries the
        owners of the chosen functional ops (see the module docstring). Functional
        ops called by the root module's own forward (e.g. ``add_1`` at the root)
        cannot be told apart from the global qconfig and are never chosen.

    Raises:
        ValueError: a budget outside [0, 1] or an unknown ``budget_unit``; an
            int16 budget on a march without int16 activations (e.g. bernoulli2);
            ``calib_model`` without a qconfig to build on; ``float_weights`` on a
            model whose weights are already rounded; no batch (on every rank alike).
        TypeError: ``batches`` is an iterator of batches given as one tensor or dict.
    """
    from fxq.debug import sensitivity

    int16_budget = _check_budget("int16_budget", int16_budget)
    float_share = _check_budget("float_budget", float_budget)
    if ranking not in RANKINGS:
        raise ValueError(f"mixed_precision: ranking must be one of {RANKINGS}, got {ranking!r}")
    if budget_unit not in BUDGET_UNITS:
        raise ValueError(
            f"mixed_precision: budget_unit must be one of {BUDGET_UNITS}, got {budget_unit!r}"
        )
    qat_modules = [m for m in calib_model.modules() if isinstance(m, QATModule)]
    if int16_budget > 0 and qat_modules:
        spec = spec_for(qat_modules[0].march)
        if not spec.supports_activation(qint16):
            raise ValueError(
                f"mixed_precision: march {spec.march.value} has no int16 activations (it runs: "
                f"{spec.allowed_dtype_names()}); use int16_budget=0 (and float_budget for float "
                "ops), or a march with int16 such as fxq.set_march('bayes')"
            )
    batches = one_or_more_batches(batches, "mixed_precision", "batches", ranks="nonempty")
    base = dict(qconfig_dict) if qconfig_dict is not None else {}
    if "" not in base:
        common = _common_qconfig(calib_model)
        if common is None:
            raise ValueError("mixed_precision: calib_model has no QAT module with a qconfig")
        base[""] = common
    modules = dict(calib_model.named_modules())
    targets = _targets(calib_model, dict(float_model.named_modules()))
    chosen: dict[str, QConfig | None] = {}  # by activation (row) name
    float_rows: list[dict[str, Any]] = []
    int16_rows: list[dict[str, Any]] = []
    weights = weight_quants(calib_model) if float_weights else []  # left unrounded
    if float_weights and _weights_on_their_grid(calib_model):
        raise ValueError(
            "mixed_precision: float_weights=True, but every weight of calib_model already lies "
            "on its int8 grid (learned rounding writes the rounded weights back, as ptq's "
            "'default' and 'best' do), so bypassing the weight fake quants would not measure "
            "float weights; rank on a model calibrated without learned rounding: "
            "ptq(model, data, iters=0)"
        )
    # each activation's elements, when a budget counts bytes
    sizes = (
        _activation_sizes(calib_model, batches, input_fn)
        if budget_unit == "bytes" and (int16_budget > 0 or float_share > 0)
        else None
    )
    if float_share > 0:
        with bypassed(weights):
            rows = sensitivity(
                float_model,
                calib_model,
                batches,
                mode="float_one",
                kinds=("activation",),
                input_fn=input_fn,
                output_fn=output_fn,
            )
        budget = _Budget(float_share, rows, sizes, targets)
        for row in budget.order(rows):
            if budget.spent:
                break
            if _free(row["name"], targets, chosen) and budget.take(row["name"]):
                chosen.update(dict.fromkeys(targets[row["name"]].members))
                float_rows.append(row)
    if int16_budget > 0:
        how = {"dtype": qint16} if ranking == "raise_one" else {"mode": "quantize_one"}
        with bypassed(weights):
            rows = sensitivity(
                float_model,
                calib_model,
                batches,
                kinds=("activation",),
                input_fn=input_fn,
                output_fn=output_fn,
                **how,
            )
        if ranking == "quantize_one":
            rows = _as_raised(rows)
        # activations that are int16 already (an output ptq widened, a qconfig's int16) are
        # paid for first: the budget bounds the model's int16 share, not the new choices'
        already = {
            name
            for name, fq in _stored_activations(calib_model).items()
            if fq.dtype is qint16 and name not in chosen
        }
        budget = _Budget(int16_budget, rows, sizes, targets, spent=already)
        for row in budget.order(rows):
            if budget.spent:
                break
            name = row["name"]
            if not _free(name, targets, chosen):
                continue
            gain = row["sqnr"] - row["baseline"]
            if not (gain >= min_gain_db and gain > 0):  # also a NaN SQNR
                continue
            qconfig = getattr(modules.get(name), "qconfig", None)
            if not isinstance(qconfig, QConfig) or not budget.take(name):
                continue
            for member in targets[name].members:
                chosen[member] = _int16_qconfig(modules[member].qconfig)
            int16_rows.append(row)
    chosen = _rank0_choice(chosen, modules)
    if show:
        for kind, rows in (("float", float_rows), ("int16", int16_rows)):
            for row in rows:
                print(f"{kind:5s} {row['name']}: output SQNR {row['sqnr']:.2f} dB")
    entries = dict(base.get("module_name") or {})
    patterns = base.get("module_name_regex") or []
    patterns = list(patterns.items() if isinstance(patterns, Mapping) else patterns)
    for name, qconfig in chosen.items():
        target = targets[name]
        if target.functional:
            pattern = re.escape(target.key)
            if all(p != pattern for p, _ in patterns):
                patterns.append((pattern, qconfig))
        else:
            entries[target.key] = qconfig
    base["module_name"] = entries
    if patterns:
        base["module_name_regex"] = patterns
    return base


@dataclass(frozen=True)
class _Target:
    """How a qconfig_dict reaches one quantized activation.

    Attributes:
        key: a module path of the float model: the activation's own module, or, for a
            functional op (``functional``), the module whose forward calls it.
        functional: reached by a ``module_name_regex`` entry matching exactly ``key``
            (its own ops, not its submodules') instead of a ``module_name`` entry.
        members: the activations (row names) that entry reaches, this one included: every
            quantized functional op of the same owner.
    """

    key: str
    functional: bool
    members: tuple[str, ...]


def _owner(node: Node) -> str:
    """The module path whose forward called ``node`` when the model was traced ("" for the
    root, or when the tracer recorded none)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    last = list(stack.values())[-1]
    return last[0] if isinstance(last, tuple) else str(last)


def _targets(calib_model: GraphModule, float_names: Mapping[str, nn.Module]) -> dict[str, _Target]:
    """The quantized activations of ``calib_model`` that a qconfig_dict can reach on their
    own, by row name (``fxq.debug.sensitivity``'s ``name``).

    A module of the float model is reached by its name. A functional op is reached through
    its owner, when the owner is a module of the float model other than the root and every
    op it calls itself was given the global qconfig (no other entry of the dict reaches
    them, so a regex matching only the owner's path changes exactly those ops).
    """
    from fxq.debug.sensitivity import quantized_values

    values = [v for v in quantized_values(calib_model) if v.kind == "activation"]
    targets = {
        v.name: _Target(v.name, False, (v.name,))
        for v in values
        if v.name and v.name in float_names
    }
    only_global: dict[str, bool] = {}  # owner path -> every op it calls took the global qconfig
    for node in calib_model.graph.nodes:
        source = node.meta.get("fxq_qconfig")
        if source is None or (node.op == "call_module" and node.target in float_names):
            continue
        owner = _owner(node)
        only_global[owner] = only_global.get(owner, True) and source.startswith("global:")
    owned: dict[str, list[str]] = {}
    for v in values:
        if v.name in targets or v.node is None:
            continue
        owner = _owner(v.node)
        if owner and owner in float_names and only_global.get(owner, False):
            owned.setdefault(owner, []).append(v.name)
    for owner, members in owned.items():
        for name in members:
            targets[name] = _Target(owner, True, tuple(members))
    return targets


def _free(name: str, targets: Mapping[str, _Target], chosen: Mapping[str, Any]) -> bool:
    """Whether the activation ``name`` can be reached and no choice has reached it yet."""
    return name in targets and name not in chosen


class _Budget:
    """What is left of a budget: a number of activations (``sizes`` None) or of their
    elements (``sizes``: each activation's, by name). Choosing an activation pays for every
    activation its qconfig_dict entry reaches (``targets``)."""

    def __init__(
        self,
        share: float,
        rows: list[dict[str, Any]],
        sizes: dict[str, int] | None,
        targets: Mapping[str, _Target],
        spent: set[str] = frozenset(),
    ) -> None:
        self.sizes = sizes
        self.targets = targets
        measured = [r["name"] for r in rows]
        paid = [name for name in measured if name in spent]
        if sizes is None:
            self.left = math.floor(share * len(rows) + 1e-9) - len(paid)
        else:
            total = sum(sizes.get(name, 0) for name in measured)
            self.left = share * total - sum(sizes.get(name, 0) for name in paid)

    def cost(self, name: str) -> int:
        """What choosing ``name`` costs: activations, or their elements (0: not reached on
        the batch measured, or not reachable)."""
        target = self.targets.get(name)
        if target is None:
            return 0
        if self.sizes is None:
            return len(target.members)
        if not all(self.sizes.get(m) for m in target.members):
            return 0
        return sum(self.sizes[m] for m in target.members)

    def order(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``rows`` (best first) in the order to take them: as they are for a count; for
        elements, by the output noise each removes per element it costs (an early, large
        map must gain as much as the several small ones its elements would pay for)."""
        if self.sizes is None or not rows:
            return rows
        noise = 10 ** (-rows[0]["baseline"] / 10)

        def removed_per_element(row: dict[str, Any]) -> float:
            value = (noise - 10 ** (-row["sqnr"] / 10)) / max(self.cost(row["name"]), 1)
            return value if math.isfinite(value) else -math.inf

        return sorted(rows, key=removed_per_element, reverse=True)

    @property
    def spent(self) -> bool:
        return self.left < 1 if self.sizes is None else self.left <= 0

    def take(self, name: str) -> bool:
        """Spend ``name``'s cost if it fits (else nothing; a smaller one may fit later)."""
        cost = self.cost(name)
        if not cost or cost > self.left:
            return False  # unreachable, not reached on the batch measured, or too large
        self.left -= cost
        return True


def _stored_activations(calib_model: GraphModule) -> dict[str, Any]:
    """The activation fake quants of tensors the integer model stores, by module name (not
    a sum fused on chip with its normalization)."""
    from fxq.debug.sensitivity import quantized_values

    return {
        v.name: v.fake_quant
        for v in quantized_values(calib_model)
        if v.kind == "activation" and not v.fake_quant.on_chip_with
    }


def _activation_sizes(
    calib_model: GraphModule, batches: list[Any], input_fn: Callable[[Any], Any] | None = None
) -> dict[str, int]:
    """The elements each quantized activation holds on the first batch, by module name
    (one float pass with the fake quants bypassed: no statistics change)."""
    from fxq.debug.capture import eval_no_grad
    from fxq.fake_quantize import bypass

    sizes: dict[str, int] = {}

    def count(name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor):
                sizes[name] = sizes.get(name, 0) + output.numel()

        return hook

    args, kwargs = batch_arguments(calib_model, batches[0], input_fn)  # as sensitivity reads it
    handles = [
        fq.register_forward_hook(count(name))
        for name, fq in _stored_activations(calib_model).items()
    ]
    try:
        with eval_no_grad(calib_model), bypass(calib_model):
            calib_model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return sizes


def _rank0_choice(
    chosen: dict[str, QConfig | None], modules: dict[str, nn.Module]
) -> dict[str, QConfig | None]:
    """Rank 0's choice on every rank of a ``torch.distributed`` run (each rank ranked on its
    own batches; one qconfig_dict must come out); ``chosen`` itself outside one."""
    if world_size() < 2:
        return chosen
    import torch.distributed as dist

    picked = [[(name, qconfig is None) for name, qconfig in chosen.items()]]
    dist.broadcast_object_list(picked, src=0)
    return {
        name: None if is_float else _int16_qconfig(modules[name].qconfig)
        for name, is_float in picked[0]
    }
