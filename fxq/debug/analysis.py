"""``QuantAnalysis``: the whole toolbox on the inputs where the models disagree most."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from fxq.calibration.data import batch_arguments, each_batch, no_batch_error, one_batch
from fxq.debug.capture import (
    eval_no_grad,
    require_fake_quant_model,
    validation_state,
    vendor_argument_ignored,
)
from fxq.debug.metrics import Similarity, similarity_for
from fxq.debug.report import HtmlPage, text_table, write_text
from fxq.debug.sensitivity import sensitivity as _sensitivity
from fxq.debug.similarity import (
    featuremap_similarity,
    ordered_by_op_error,
    write_similarity_files,
)
from fxq.debug.statistics import get_raw_features, profile_featuremap
from fxq.debug.weights import compare_weights

__all__ = ["QuantAnalysis"]

_BAD_CASE_COLUMNS = ("rank", "batch", "sample", "metric")

#: the vendor plugin's ``analysis_model_type`` values
ANALYSIS_MODEL_TYPES = ("fake_quant", "quantized")


class QuantAnalysis:
    """Find the inputs where a quantized model departs most from float, and why.

    The vendor plugin's workflow, on fxq models, with its arguments::

        qa = fxq.debug.QuantAnalysis(float_model, calibrated_model, "fake_quant", out_dir="debug")
        qa.auto_find_bad_case(val_batches)   # the worst sample, by a metric
        qa.run()                             # every tool on it; report.html links them

    fxq's shorter form ``QuantAnalysis(float_model, calibrated_model, "debug")`` (the
    output folder third) is the same.

    Args:
        baseline_model: the float model (the reference).
        analysis_model: the calibrated or QAT model from ``prepare_qat_fx``, in any
            fake-quant state: it is measured in VALIDATION (see
            ``fxq.debug.capture.validation_state``) and its states are restored after.
        analysis_model_type: ``"fake_quant"`` (the vendor's name for a calibrated or
            QAT model; the default). ``"quantized"`` (an integer model against its QAT
            model) is refused: compare those with ``compare_qat_quantized`` or
            ``featuremap_similarity``. Any other string or path here is ``out_dir``
            (fxq's own order).
        device_ids: the vendor plugin's GPUs to run on; ignored with a warning (the
            models run where they are).
        post_process: applied to both models' outputs before they are compared when
            looking for the bad case (e.g. a detection head's decoding).
        out_dir: where the files go: ``bad_case.txt``, ``compare_per_layer/``,
            ``statistic/``, ``weights/``, ``sensitivity/`` and ``report.html``
            (default ``./quant_analysis``).
        input_fn: maps a batch to the models' arguments (``fxq.calibration.data``); a
            tensor, an ``(images, labels)`` tuple or a dict of keyword inputs need none.

    Raises:
        TypeError: ``analysis_model`` is not a calibrated or QAT model from
            ``prepare_qat_fx``: a float model, or a converted (integer) model.
        ValueError: an ``analysis_model_type`` of ``"quantized"``.
    """

    def __init__(
        self,
        baseline_model: nn.Module,
        analysis_model: nn.Module,
        analysis_model_type: str | os.PathLike = "fake_quant",
        device_ids: Any = None,
        post_process: Callable[[Any], Any] | None = None,
        out_dir: str | os.PathLike | None = None,
        *,
        input_fn: Callable[[Any], Any] | None = None,
    ) -> None:
        if analysis_model_type not in ANALYSIS_MODEL_TYPES and out_dir is None:
            # fxq's own order: (float_model, calib_model, out_dir, input_fn)
            out_dir, analysis_model_type = analysis_model_type, "fake_quant"
            if callable(device_ids) and input_fn is None:
                input_fn, device_ids = device_ids, None
        if analysis_model_type == "quantized":
            raise ValueError(
                "QuantAnalysis: analysis_model_type='quantized' (an integer model against its "
                "QAT model) is not supported; compare them layer by layer with "
                "fxq.debug.featuremap_similarity(qat_model, quantized_model, inputs) or "
                "fxq.debug.compare_qat_quantized(qat_model, quantized_model, inputs)"
            )
        if analysis_model_type != "fake_quant":
            raise ValueError(
                f"QuantAnalysis: analysis_model_type must be one of {ANALYSIS_MODEL_TYPES}, "
                f"got {analysis_model_type!r}"
            )
        require_fake_quant_model(analysis_model, "QuantAnalysis", "the analysis model")
        if device_ids is not None:
            vendor_argument_ignored(
                "QuantAnalysis", "device_ids", "the models run on the device they are on"
            )
        self.float_model = baseline_model
        self.model = analysis_model
        self.out_dir = Path(out_dir if out_dir is not None else "quant_analysis")
        self.input_fn = input_fn
        self.post_process = post_process
        self.bad_case: tuple | dict | None = None
        self.bad_cases: list[dict[str, Any]] = []
        self.results: dict[str, list[dict[str, Any]]] = {}

    # -- bad cases ---------------------------------------------------------------------
    def _outputs(self, model: nn.Module, batch: Any) -> tuple[Any, tuple, dict]:
        args, kwargs = batch_arguments(model, batch, self.input_fn)
        out = model(*args, **kwargs)
        return (self.post_process(out) if self.post_process is not None else out), args, kwargs

    def auto_find_bad_case(
        self,
        batches: Iterable[Any],
        num_steps: int | None = None,
        metric: str | Callable[[Tensor, Tensor], float] = "sqnr",
        device: Any = None,
        custom_metric_func: Callable[[Any, Any], float] | None = None,
        custom_metric_order_seq: str | None = None,
        cached_attrs: Any = None,
    ) -> list[dict[str, Any]]:
        """Run both models on ``batches`` and keep the sample where they differ most.

        Args:
            batches: an iterable of batches (``fxq.calibration.data``: tensors,
                ``(images, labels)`` tuples, dicts of keyword inputs, or anything
                ``input_fn`` maps); samples are along dimension 0.
            num_steps: look at this many batches at most.
            metric: per-sample measure of the outputs: ``"sqnr"``, ``"cosine"``,
                ``"mse"``, ``"l1"``, ``"max_abs"`` (any case: the vendor's ``"L1"``...)
                or a callable ``(float_output, quantized_output) -> float`` (higher means
                better); ``"custom"`` takes ``custom_metric_func``.
            device, cached_attrs: the vendor plugin's options; ignored with a warning
                when set (the models run where they are; fxq keeps no cached attributes).
            custom_metric_func: with ``metric="custom"``, ``(float_output,
                quantized_output) -> float``.
            custom_metric_order_seq: with ``metric="custom"``, the order from bad to good:
                ``"ascending"`` (the smallest value is the worst) or ``"descending"``.

        Returns:
            one dict per sample, worst first: ``rank``, ``batch``, ``sample``, ``metric``.
            The worst sample becomes ``bad_case`` (a batch of one); ``bad_case.txt``
            lists the 20 worst.

        Raises:
            ValueError: no batch, a bad metric, or a ``"custom"`` metric without its
                function and order.
            TypeError: ``batches`` is one tensor or one dict (wrap it in a list).
        """
        who = "QuantAnalysis.auto_find_bad_case"
        for name, value in (("device", device), ("cached_attrs", cached_attrs)):
            if value is not None:
                vendor_argument_ignored(who, name, "the models run as they are, where they are")
        sim = _metric(metric, custom_metric_func, custom_metric_order_seq)
        rows: list[dict[str, Any]] = []
        samples: dict[tuple[int, int], tuple[tuple, dict]] = {}
        with (
            eval_no_grad(self.float_model, self.model),
            validation_state(self.float_model, self.model),
        ):
            for b, batch in enumerate(each_batch(batches, num_steps, who, "batches")):
                ref, _, _ = self._outputs(self.float_model, batch)
                out, args, kwargs = self._outputs(self.model, batch)
                for i in range(_batch_size(args, kwargs)):
                    value = sim.fn(_sample(ref, i), _sample(out, i))
                    rows.append({"batch": b, "sample": i, "metric": value})
                    samples[(b, i)] = (args, kwargs)
        if not rows:
            raise no_batch_error(batches, who, "batches")
        rows.sort(key=lambda r: sim.worst_first_key(r["metric"]))
        for rank, r in enumerate(rows):
            r["rank"] = rank
        worst = rows[0]
        args, kwargs = samples[(worst["batch"], worst["sample"])]
        self.bad_case = _sample_args(args, kwargs, worst["sample"])
        self.bad_cases = rows
        self.metric_name = sim.name
        write_text(
            self.out_dir / "bad_case.txt",
            f"per-sample model output {sim.name}, worst first\n"
            + text_table(rows[:20], _BAD_CASE_COLUMNS),
        )
        return rows

    def set_bad_case(
        self,
        inputs: Any,
        baseline_model_cached_attr: Any = None,
        analysis_model_cached_attr: Any = None,
    ) -> None:
        """Use ``inputs`` as the bad case: the models' inputs (a tensor, a tuple of
        positional inputs or a dict of keyword inputs). The vendor plugin's cached
        attributes are ignored with a warning when given.

        Raises:
            ValueError: ``inputs`` is empty or holds no sample.
        """
        for name, value in (
            ("baseline_model_cached_attr", baseline_model_cached_attr),
            ("analysis_model_cached_attr", analysis_model_cached_attr),
        ):
            if value:
                vendor_argument_ignored(
                    "QuantAnalysis.set_bad_case", name, "fxq keeps no cached attributes"
                )
        one_batch(inputs, "QuantAnalysis.set_bad_case")
        if isinstance(inputs, Mapping):
            self.bad_case = dict(inputs)
        elif isinstance(inputs, (tuple, list)):
            self.bad_case = tuple(inputs)
        else:
            self.bad_case = (inputs,)

    def _require_bad_case(self) -> tuple | dict:
        if self.bad_case is None:
            raise RuntimeError(
                "QuantAnalysis: no bad case yet; call auto_find_bad_case(batches) or "
                "set_bad_case(inputs) first"
            )
        return self.bad_case

    # -- the tools on the bad case ---------------------------------------------------------
    def compare_per_layer(
        self,
        similarity_func: str | Callable[[Any, Any], float] = "cosine",
        prefixes: Sequence[str] | None = None,
        types: Sequence[type | str] | None = None,
    ) -> list[dict[str, Any]]:
        """``featuremap_similarity`` of the float and the quantized model on the bad case
        (files in ``compare_per_layer/``).

        Args:
            similarity_func: as ``featuremap_similarity`` takes it.
            prefixes: keep only the layers whose node name or module path starts with one
                of these (the vendor's first argument: a tuple there is ``prefixes``).
            types: keep only the layers whose module is an instance of one of these
                classes (or whose type name is one of these strings).
        """
        if isinstance(similarity_func, (tuple, list)):  # the vendor's order
            prefixes, similarity_func = similarity_func, "cosine"
        sim = similarity_for(similarity_func)
        rows = featuremap_similarity(
            self.float_model, self.model, self._require_bad_case(), similarity_func=sim
        )
        if prefixes or types:
            rows = [r for r in rows if self._selected(r, prefixes, types)]
            for i, r in enumerate(rows):
                r["index"] = i
        write_similarity_files(rows, self.out_dir / "compare_per_layer", sim)
        self.results["compare_per_layer"] = rows
        self._similarity = sim
        return rows

    def _selected(
        self, row: dict[str, Any], prefixes: Sequence[str] | None, types: Sequence[Any] | None
    ) -> bool:
        if prefixes and not any(
            str(n).startswith(p) for n in (row["layer"], row["module"]) for p in prefixes
        ):
            return False
        if types:
            try:
                module = self.model.get_submodule(str(row["module"]))
            except AttributeError:
                module = None
            name = row["type"].split("(")[0]
            return any(
                name == t if isinstance(t, str) else module is not None and isinstance(module, t)
                for t in types
            )
        return True

    def statistics(self) -> list[dict[str, Any]]:
        """``profile_featuremap`` of the quantized model's float values on the bad case
        (files in ``statistic/``)."""
        features = get_raw_features(self.model, self._require_bad_case(), float_values=True)
        rows = profile_featuremap(features, out_dir=self.out_dir / "statistic")
        self.results["statistic"] = rows
        return rows

    def compare_weights(self) -> list[dict[str, Any]]:
        """``compare_weights`` of the two models (files in ``weights/``)."""
        rows = compare_weights(self.float_model, self.model, out_dir=self.out_dir / "weights")
        self.results["weights"] = rows
        return rows

    def sensitivity(
        self,
        inputs: Any = None,
        metric: str | Callable[[Tensor, Tensor], float] | None = None,
        mode: str = "quantize_one",
        *,
        device: Any = None,
        reverse: bool = False,
    ) -> list[dict[str, Any]]:
        """``fxq.debug.sensitivity`` on ``inputs`` (default: the bad case; batches that
        ``input_fn`` maps); files in ``sensitivity/``.

        Args:
            inputs: one batch or a list of batches (``fxq.calibration.data``).
            metric: as ``fxq.debug.sensitivity`` takes it (the vendor's ``"L1"`` too).
            mode: ``"quantize_one"`` or ``"float_one"``.
            device: the vendor plugin's device; ignored with a warning when set.
            reverse: least sensitive first (the vendor's option: the values that can
                stay int8 most safely).
        """
        if device is not None:
            vendor_argument_ignored(
                "QuantAnalysis.sensitivity", "device", "the models run on the device they are on"
            )
        rows = _sensitivity(
            self.float_model,
            self.model,
            self._require_bad_case() if inputs is None else inputs,
            metric=metric,
            mode=mode,
            out_dir=self.out_dir / "sensitivity",
            input_fn=None if inputs is None else self.input_fn,
        )
        if reverse:
            rows = rows[::-1]
            for i, r in enumerate(rows):
                r["rank"] = i
        self.results["sensitivity"] = rows
        return rows

    def run(
        self, with_sensitivity: bool = True, device: Any = None, index: int | None = None
    ) -> dict[str, list[dict[str, Any]]]:
        """Every tool on the bad case, then ``report.html``; returns the rows by tool name.

        Args:
            with_sensitivity: run ``sensitivity`` too (the slowest tool).
            device: the vendor plugin's device; ignored with a warning when set (a first
                argument that is no bool is the vendor's ``device``).
            index: the vendor plugin's choice of another bad input; ignored with a warning
                when set: call ``set_bad_case`` with it.
        """
        if not isinstance(with_sensitivity, bool):  # the vendor's order: run(device, index)
            device, with_sensitivity = with_sensitivity, True
        if device is not None:
            vendor_argument_ignored(
                "QuantAnalysis.run", "device", "the models run on the device they are on"
            )
        if index is not None:
            vendor_argument_ignored(
                "QuantAnalysis.run", "index", "pass that input to set_bad_case(inputs) instead"
            )
        self.compare_per_layer()
        self.statistics()
        self.compare_weights()
        if with_sensitivity:
            self.sensitivity()
        self.report()
        return self.results

    def report(self) -> Path:
        """Write ``report.html``: the bad cases, the worst layers of each tool, links."""
        page = HtmlPage("quantization analysis")
        if self.bad_cases:
            page.heading("Bad cases (worst first)")
            page.table("bad-cases", _BAD_CASE_COLUMNS, self.bad_cases[:10], marked={0})
        layers = self.results.get("compare_per_layer")
        if layers:
            sim: Similarity = self._similarity
            page.heading("Layers with the largest own error")
            page.table(
                "worst-layers",
                ("layer", "module", "type", "op_similarity", "op_sqnr", "sqnr", "max_lsb"),
                ordered_by_op_error(layers, sim)[:10],
            )
            page.link("compare_per_layer/similarity.html", "featuremap similarity (all layers)")
        if "statistic" in self.results:
            clipped = [r for r in self.results["statistic"] if r["attr"] == "output"]
            clipped.sort(key=lambda r: -(r["clipped"] or 0.0))
            page.heading("Most clipped outputs")
            page.table("clipped", ("layer", "type", "min", "max", "scale", "clipped"), clipped[:10])
            page.link("statistic/statistic.html", "feature map statistics and histograms")
        if "weights" in self.results:
            page.heading("Weights with the worst channels")
            page.table(
                "weights",
                ("layer", "type", "min_channel_sqnr", "worst_channels"),
                self.results["weights"][:10],
            )
            page.link("weights/weight_comparison.html", "weight comparison")
        rows = self.results.get("sensitivity")
        if rows:
            metric = next(k for k in rows[0] if k not in ("name", "kind", "type", "dtype"))
            page.heading("Most sensitive values")
            page.table("sensitivity", ("rank", "name", "kind", "type", metric), rows[:10])
            page.link("sensitivity/sensitivity.html", "sensitivity (all values)")
        return page.write(self.out_dir / "report.html")


def _metric(
    metric: Any, custom: Callable[[Any, Any], float] | None, order: str | None
) -> Similarity:
    """The per-sample measure: fxq's names and callables, or the vendor's ``"custom"``."""
    if metric != "custom":
        return similarity_for(metric)
    if custom is None or order not in ("ascending", "descending"):
        raise ValueError(
            "auto_find_bad_case: metric='custom' needs custom_metric_func and "
            "custom_metric_order_seq ('ascending': the smallest value is the worst, or "
            f"'descending'), got {custom!r} and {order!r}"
        )
    return Similarity(getattr(custom, "__name__", "custom"), custom, order == "ascending")


def _batch_size(args: tuple, kwargs: dict) -> int:
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor) and a.dim() > 0:
            return a.shape[0]
    raise ValueError("auto_find_bad_case: a batch holds no tensor with a batch dimension")


def _sample(out: Any, i: int) -> Any:
    if isinstance(out, Tensor):
        return out[i] if out.dim() > 0 else out
    if isinstance(out, (tuple, list)):
        return type(out)(_sample(o, i) for o in out)
    if isinstance(out, dict):
        return {k: _sample(v, i) for k, v in out.items()}
    return out


def _one(value: Any, i: int) -> Any:
    return value[i : i + 1].clone() if isinstance(value, Tensor) and value.dim() > 0 else value


def _sample_args(args: tuple, kwargs: dict, i: int) -> tuple | dict:
    """Sample ``i`` of a batch's arguments: a tuple of positional inputs, or a dict of
    keyword inputs when the batch gave keywords."""
    if kwargs:
        return {k: _one(v, i) for k, v in kwargs.items()}
    return tuple(_one(a, i) for a in args)
