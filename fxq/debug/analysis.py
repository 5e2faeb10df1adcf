"""``QuantAnalysis``: the whole toolbox on the inputs where the models disagree most."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from fxq.debug.capture import as_inputs, eval_no_grad, is_fxq_model
from fxq.debug.metrics import Similarity, similarity_for
from fxq.debug.report import HtmlPage, text_table, write_text
from fxq.debug.sensitivity import sensitivity as _sensitivity
from fxq.debug.similarity import featuremap_similarity, ordered_by_op_error
from fxq.debug.statistics import get_raw_features, profile_featuremap
from fxq.debug.weights import compare_weights

__all__ = ["QuantAnalysis"]

_BAD_CASE_COLUMNS = ("rank", "batch", "sample", "metric")


class QuantAnalysis:
    """Find the inputs where a quantized model departs most from float, and why.

    The vendor plugin's workflow, on fxq models::

        qa = fxq.debug.QuantAnalysis(float_model, calibrated_model, "debug_out")
        qa.auto_find_bad_case(val_batches)   # the worst sample, by a metric
        qa.run()                             # every tool on it; report.html links them

    Args:
        float_model: the float model (the reference).
        calib_or_qat_model: the calibrated or QAT model from ``prepare_qat_fx``, in
            the fake-quant state to analyse (usually VALIDATION).
        out_dir: where the files go: ``bad_case.txt``, ``compare_per_layer/``,
            ``statistic/``, ``weights/``, ``sensitivity/`` and ``report.html``.
        input_fn: maps a batch to the models' positional arguments (a tuple) when a
            batch is not already a tensor or a tuple of them (e.g. ``lambda b: (b[0],)``
            for ``(images, labels)``).

    Raises:
        TypeError: ``calib_or_qat_model`` is not a model from ``prepare_qat_fx``.
    """

    def __init__(
        self,
        float_model: nn.Module,
        calib_or_qat_model: nn.Module,
        out_dir: str | Path,
        input_fn: Callable[[Any], tuple] | None = None,
    ) -> None:
        if not is_fxq_model(calib_or_qat_model):
            raise TypeError(
                "QuantAnalysis: the second model must be the calibrated or QAT model from "
                f"fxq.prepare_qat_fx, got a float {type(calib_or_qat_model).__name__}"
            )
        self.float_model = float_model
        self.model = calib_or_qat_model
        self.out_dir = Path(out_dir)
        self.input_fn = input_fn
        self.bad_case: tuple | None = None
        self.bad_cases: list[dict[str, Any]] = []
        self.results: dict[str, list[dict[str, Any]]] = {}

    # -- bad cases ---------------------------------------------------------------------
    def _args(self, batch: Any) -> tuple:
        return tuple(self.input_fn(batch)) if self.input_fn is not None else as_inputs(batch)

    def auto_find_bad_case(
        self,
        batches: Iterable[Any],
        num_steps: int | None = None,
        metric: str | Callable[[Tensor, Tensor], float] = "sqnr",
    ) -> list[dict[str, Any]]:
        """Run both models on ``batches`` and keep the sample where they differ most.

        Args:
            batches: an iterable of batches (tensors, tuples of positional inputs, or
                anything ``input_fn`` maps); samples are along dimension 0.
            num_steps: look at this many batches at most.
            metric: per-sample measure of the outputs: ``"sqnr"``, ``"cosine"``,
                ``"mse"``, ``"l1"``, ``"max_abs"`` or a callable ``(float_output,
                quantized_output) -> float`` (higher means better).

        Returns:
            one dict per sample, worst first: ``rank``, ``batch``, ``sample``, ``metric``.
            The worst sample becomes ``bad_case`` (a batch of one); ``bad_case.txt``
            lists the 20 worst.

        Raises:
            ValueError: no batch, or a bad metric.
        """
        sim = similarity_for(metric)
        rows: list[dict[str, Any]] = []
        samples: dict[tuple[int, int], tuple] = {}
        with eval_no_grad(self.float_model, self.model):
            for b, batch in enumerate(batches):
                if num_steps is not None and b >= num_steps:
                    break
                args = self._args(batch)
                ref, out = self.float_model(*args), self.model(*args)
                for i in range(_batch_size(args)):
                    value = sim.fn(_sample(ref, i), _sample(out, i))
                    rows.append({"batch": b, "sample": i, "metric": value})
                    samples[(b, i)] = args
        if not rows:
            raise ValueError("auto_find_bad_case: `batches` yielded no batch")
        rows.sort(key=lambda r: sim.worst_first_key(r["metric"]))
        for rank, r in enumerate(rows):
            r["rank"] = rank
        worst = rows[0]
        self.bad_case = _sample_args(samples[(worst["batch"], worst["sample"])], worst["sample"])
        self.bad_cases = rows
        self.metric_name = sim.name
        write_text(
            self.out_dir / "bad_case.txt",
            f"per-sample model output {sim.name}, worst first\n"
            + text_table(rows[:20], _BAD_CASE_COLUMNS),
        )
        return rows

    def set_bad_case(self, inputs: Any) -> None:
        """Use ``inputs`` (one input or a tuple of positional inputs) as the bad case."""
        self.bad_case = as_inputs(inputs)

    def _require_bad_case(self) -> tuple:
        if self.bad_case is None:
            raise RuntimeError(
                "QuantAnalysis: no bad case yet; call auto_find_bad_case(batches) or "
                "set_bad_case(inputs) first"
            )
        return self.bad_case

    # -- the tools on the bad case ---------------------------------------------------------
    def compare_per_layer(
        self, similarity_func: str | Callable[[Any, Any], float] = "cosine"
    ) -> list[dict[str, Any]]:
        """``featuremap_similarity`` of the float and the quantized model on the bad case
        (files in ``compare_per_layer/``)."""
        rows = featuremap_similarity(
            self.float_model,
            self.model,
            self._require_bad_case(),
            similarity_func=similarity_func,
            out_dir=self.out_dir / "compare_per_layer",
        )
        self.results["compare_per_layer"] = rows
        self._similarity = similarity_for(similarity_func)
        return rows

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
    ) -> list[dict[str, Any]]:
        """``fxq.debug.sensitivity`` on ``inputs`` (default: the bad case); files in
        ``sensitivity/``."""
        rows = _sensitivity(
            self.float_model,
            self.model,
            self._require_bad_case() if inputs is None else inputs,
            metric=metric,
            mode=mode,
            out_dir=self.out_dir / "sensitivity",
        )
        self.results["sensitivity"] = rows
        return rows

    def run(self, with_sensitivity: bool = True) -> dict[str, list[dict[str, Any]]]:
        """Every tool on the bad case, then ``report.html``; returns the rows by tool name."""
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


def _batch_size(args: tuple) -> int:
    for a in args:
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


def _sample_args(args: tuple, i: int) -> tuple:
    return tuple(a[i : i + 1].clone() if isinstance(a, Tensor) and a.dim() > 0 else a for a in args)
