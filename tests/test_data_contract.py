"""One data contract for every function that takes calibration or evaluation data
(``fxq.calibration.data``), and the debug tools' vendor argument forms."""

from __future__ import annotations

import re
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import fxq
from fxq.calibration import (
    auto_calibrate,
    bias_correction,
    calibrate,
    mixed_precision,
    ptq,
    tune_biases,
    weight_reconstruction,
)
from fxq.calibration.equalization import equalize_depthwise
from fxq.debug import (
    QuantAnalysis,
    compare_qat_quantized,
    compare_weights,
    featuremap_similarity,
    get_raw_features,
    profile_featuremap,
    sensitivity,
)
from fxq.qconfig import default_calib_8bit_fake_quant_qconfig as calib_q8


class DepthwiseNet(nn.Module):
    """conv-bn-relu, a depthwise conv and a linear head: every recipe has work to do."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.dw = nn.Conv2d(width, width, 3, padding=1, groups=width)
        self.fc = nn.Linear(width, 4)

    def forward(self, image):
        x = torch.relu(self.bn(self.conv(image)))
        x = torch.relu(self.dw(x))
        return self.fc(x.mean((2, 3)))


class VarArgsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)

    def forward(self, *inputs):
        return self.conv(inputs[0])


def _images(count: int = 2, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, 8, 8, generator=g) for _ in range(count)]


def _float(width: int = 8) -> DepthwiseNet:
    torch.manual_seed(0)
    model = DepthwiseNet(width).eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.2, 0.2)
        model.bn.running_var.uniform_(0.5, 1.5)
    return model


def _prepared(model: nn.Module | None = None) -> torch.fx.GraphModule:
    return fxq.prepare_qat_fx(model or _float(), {"": calib_q8})


def _calibrated(model: nn.Module | None = None) -> torch.fx.GraphModule:
    prepared = calibrate(_prepared(model), _images(), show_progress=False)
    fxq.set_fake_quantize(prepared, "validation")
    return prepared


#: every function that takes ``data``: name -> call(data, **options) on fresh models
RECIPES = {
    "calibrate": lambda data, **kw: calibrate(_prepared(), data, show_progress=False, **kw),
    "ptq": lambda data, **kw: ptq(_prepared(), data, iters=2, show_progress=False, **kw),
    "auto_calibrate": lambda data, **kw: auto_calibrate(_prepared(), data, show=False, **kw),
    "weight_reconstruction": lambda data, **kw: weight_reconstruction(
        _calibrated(), data, iters=2, show=False, show_progress=False, **kw
    ),
    "bias_correction": lambda data, **kw: bias_correction(
        _calibrated(), data, show_progress=False, **kw
    ),
    "equalize_depthwise": lambda data, **kw: equalize_depthwise(_prepared(), data, **kw),
    "tune_biases": lambda data, **kw: tune_biases(
        _calibrated(), data, float_model=_float(), epochs=1, **kw
    ),
}


@pytest.mark.parametrize("who", sorted(RECIPES))
def test_a_bare_tensor_is_refused_with_the_fix(bayes, who):
    with pytest.raises(TypeError) as info:
        RECIPES[who](torch.randn(4, 3, 8, 8))
    assert str(info.value) == (
        f"{who}: `data` is one tensor of shape (4, 3, 8, 8); iterating it would give its 4 "
        "samples one by one, not batches. Wrap it in a list: [x] (one batch), or pass a list "
        "of batches or a DataLoader"
    )


@pytest.mark.parametrize("who", sorted(RECIPES))
def test_empty_data_and_num_batches_below_one_name_the_argument_and_the_function(bayes, who):
    with pytest.raises(ValueError) as info:
        RECIPES[who]([])
    assert str(info.value).startswith(
        f"{who}: `data` (list) yielded no batch. Pass a non-empty iterable of batches (a "
        "DataLoader, or a list of tensors); an iterator or generator can only be consumed once."
    )
    for bad in (0, -1):
        with pytest.raises(ValueError) as info:
            RECIPES[who](_images(), num_batches=bad)
        assert str(info.value) == (
            f"{who}: num_batches must be a positive integer or None (every batch), got {bad}"
        )


@pytest.mark.parametrize("who", sorted(RECIPES))
def test_batches_without_a_sample_are_refused_naming_the_function(bayes, who):
    """Batches of shape (0, ...) give nothing to observe: a clear error, not a calibration
    that observed nothing (``calibrate``) or an unrelated complaint later (``ptq``)."""
    empty = [torch.randn(0, 3, 8, 8), torch.randn(0, 3, 8, 8)]
    with pytest.raises(ValueError) as info:
        RECIPES[who](empty)
    assert str(info.value) == (
        f"{who}: every batch of `data` holds no sample (e.g. tensor shape (0, 3, 8, 8)); "
        "nothing can be observed. Pass batches with at least one sample"
    )


def test_an_empty_batch_among_others_is_skipped(bayes):
    data = _images()
    mixed = calibrate(_prepared(), [torch.randn(0, 3, 8, 8), *data], show_progress=False)
    assert _same(mixed, calibrate(_prepared(), data, show_progress=False))
    # calibrate refuses from a generator too, and leaves the model's modes as they were
    model = _prepared().train()
    with pytest.raises(ValueError, match="every batch of `data` holds no sample"):
        calibrate(model, (torch.randn(0, 3, 8, 8) for _ in range(2)), show_progress=False)
    assert model.training
    # numpy images with an empty label tensor, made inputs by input_fn: samples, calibrated
    images = [(d.numpy(), torch.zeros(0, 4)) for d in data]
    calibrated = calibrate(
        _prepared(), images, input_fn=lambda b: torch.from_numpy(b[0]), show_progress=False
    )
    assert _same(calibrated, calibrate(_prepared(), data, show_progress=False))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _same(a: nn.Module, b: nn.Module) -> bool:
    first, second = _state(a), _state(b)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("who", ["calibrate", "ptq", "bias_correction", "equalize_depthwise"])
def test_image_label_tuples_and_dicts_give_what_the_images_give(bayes, who):
    """A DataLoader's ``(image, label)`` and ``{"image": ..., "label": ...}`` batches call
    the model with the image alone: the same model, bit for bit, as the bare images."""
    images = _images()
    labels = torch.arange(4)

    def run(data: list) -> nn.Module:
        model = _calibrated() if who == "bias_correction" else _prepared()
        if who == "calibrate":
            calibrate(model, data, show_progress=False)
        elif who == "ptq":
            ptq(model, data, iters=2, show_progress=False)
        elif who == "bias_correction":
            bias_correction(model, data, show_progress=False)
        else:
            assert equalize_depthwise(model, data)  # it had something to equalize
        return model

    reference = run(images)
    assert _same(run([(x, labels) for x in images]), reference)
    assert _same(run([{"image": x, "label": labels} for x in images]), reference)


def test_input_fn_maps_anything_else(bayes):
    images = _images()
    reference = calibrate(_prepared(), images, show_progress=False)
    got = calibrate(
        _prepared(),
        [SimpleNamespace(pixels=x) for x in images],
        input_fn=lambda b: b.pixels,
        show_progress=False,
    )
    assert _same(got, reference)


def test_a_dict_without_any_input_says_to_pass_input_fn(bayes):
    prepared = fxq.prepare_qat_fx(nn.Sequential(nn.Conv2d(3, 4, 1)), {"": calib_q8})
    batch = {"image": torch.randn(2, 3, 4, 4), "label": torch.arange(2)}
    with pytest.raises(ValueError) as info:
        calibrate(prepared, [batch], show_progress=False)
    assert str(info.value) == (
        "a batch is a dict with keys ['image', 'label'], none of which is an input of "
        "Sequential.forward(input); pass input_fn to say what the model takes, e.g. "
        "input_fn=lambda batch: batch['image'] (or input_fn=lambda batch: (batch,) to pass the "
        "dict itself as the one input)"
    )
    calibrate(prepared, [batch], input_fn=lambda b: b["image"], show_progress=False)


def test_a_model_traced_from_varargs_gets_the_image_alone(bayes):
    x = torch.randn(2, 3, 4, 4)
    prepared = fxq.prepare_qat_fx(VarArgsNet().eval(), {"": calib_q8}, example_inputs=(x,))
    seen = []
    prepared.register_forward_pre_hook(lambda module, args: seen.append(len(args)))
    calibrate(prepared, [(x, torch.arange(2))], show_progress=False)
    assert seen == [1]


# -- the debug tools --------------------------------------------------------------------------


def test_sensitivity_takes_the_same_batches_and_refuses_none(bayes):
    model, prepared = _float(), _calibrated()
    images = _images()
    with pytest.raises(ValueError) as info:
        sensitivity(model, prepared, [])
    assert str(info.value).startswith("sensitivity: `inputs` (list) yielded no batch.")
    expected = sensitivity(model, prepared, images)
    for data in (
        [(x, torch.arange(4)) for x in images],
        [{"image": x, "label": torch.arange(4)} for x in images],
    ):
        rows = sensitivity(model, prepared, data)
        assert [(r["name"], r["kind"], r["sqnr"]) for r in rows] == [
            (r["name"], r["kind"], r["sqnr"]) for r in expected
        ]
    qconfig_dict = mixed_precision(model, prepared, [(x, torch.arange(4)) for x in images])
    assert qconfig_dict == mixed_precision(model, prepared, images)


def test_featuremap_similarity_refuses_zero_samples(bayes):
    model, prepared = _float(), _calibrated()
    with pytest.raises(ValueError) as info:
        featuremap_similarity(model, prepared, torch.randn(0, 3, 8, 8))
    assert str(info.value) == (
        "featuremap_similarity: `inputs` holds no sample (tensor shape (0, 3, 8, 8)); every "
        "measure on zero values would be meaningless. Pass at least one sample"
    )
    with pytest.raises(ValueError, match=r"^get_raw_features: `inputs` holds no sample"):
        get_raw_features(prepared, torch.randn(0, 3, 8, 8))
    with pytest.raises(ValueError, match=r"^featuremap_similarity: `inputs` is an empty list"):
        featuremap_similarity(model, prepared, [])
    with pytest.raises(ValueError, match=r"^compare_qat_quantized: `inputs` holds no sample"):
        compare_qat_quantized(prepared, fxq.convert_fx(prepared), torch.randn(0, 3, 8, 8))


def test_featuremap_similarity_refuses_models_of_another_structure(bayes):
    with pytest.raises(ValueError) as info:
        featuremap_similarity(_float(width=16), _calibrated(), _images()[0])
    assert str(info.value) == (
        "featuremap_similarity: layer 'conv' gives output shape(s) [(4, 16, 8, 8)] in model1 "
        "but [(4, 8, 8, 8)] in model2: the models differ in structure (e.g. in width), so their "
        "layers cannot be compared. Pass a float model and a model prepared or converted from it"
    )


def test_featuremap_similarity_takes_label_tuples_and_dicts(bayes):
    model, prepared = _float(), _calibrated()
    x = _images()[0]
    expected = [(r["layer"], r["sqnr"]) for r in featuremap_similarity(model, prepared, x)]
    assert len(expected) >= 4
    for batch in ((x, torch.arange(4)), {"image": x, "label": torch.arange(4)}):
        rows = featuremap_similarity(model, prepared, batch)
        assert [(r["layer"], r["sqnr"]) for r in rows] == expected


def test_quant_analysis_refuses_a_converted_model(bayes, tmp_path):
    integer = fxq.convert_fx(_calibrated())
    with pytest.raises(TypeError) as info:
        QuantAnalysis(_float(), integer, "fake_quant", out_dir=tmp_path)
    assert str(info.value) == (
        "QuantAnalysis: the analysis model is a converted (integer) model from fxq.convert_fx, "
        "but a fake-quant model is needed; pass the calibrated or QAT model from "
        "fxq.prepare_qat_fx (the one you converted), or compare an integer model with "
        "fxq.debug.featuremap_similarity / compare_qat_quantized"
    )
    with pytest.raises(TypeError, match=r"^sensitivity: calib_model is a converted"):
        sensitivity(_float(), integer, _images())
    with pytest.raises(ValueError, match=r"analysis_model_type='quantized' .* is not supported"):
        QuantAnalysis(_calibrated(), integer, "quantized", out_dir=tmp_path)


# -- the vendor plugin's argument forms -------------------------------------------------------


def test_profile_featuremap_takes_the_vendor_arguments(bayes, tmp_path):
    prepared = _calibrated()
    x = _images()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # with_tensorboard=False changes nothing: no note
        rows = profile_featuremap(
            get_raw_features(prepared, x), with_tensorboard=False, out_dir=tmp_path
        )
    assert rows == profile_featuremap(get_raw_features(prepared, x))
    assert (tmp_path / "statistic.txt").is_file() and (tmp_path / "statistic.html").is_file()
    note = re.escape(
        "profile_featuremap: `with_tensorboard` (an argument of the vendor plugin's tool) is "
        "accepted and ignored: fxq writes no TensorBoard logs; the histograms are in the HTML "
        "page (out_dir)"
    )
    from fxq.debug import capture

    capture._NOTED.discard(("profile_featuremap", "with_tensorboard"))
    with pytest.warns(UserWarning, match=note):  # the vendor's positional order
        assert profile_featuremap(get_raw_features(prepared, x), True, None) == rows
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a one-time note
        profile_featuremap(get_raw_features(prepared, x), with_tensorboard=True)
    vendor = get_raw_features(prepared, example_inputs=x, prefixes=(), types=())
    assert [f["layer"] for f in vendor] == [f["layer"] for f in get_raw_features(prepared, x)]
    profile_featuremap(vendor, out_dir=tmp_path, file_name="calib")
    assert (tmp_path / "calib.txt").read_text() == (tmp_path / "statistic.txt").read_text()


def test_quant_analysis_takes_the_vendor_arguments(bayes, tmp_path):
    model, prepared = _float(), _calibrated()
    data = _images(3, seed=1)
    qa = QuantAnalysis(
        model, prepared, "fake_quant", device_ids=None, post_process=None, out_dir=tmp_path
    )
    assert qa.out_dir == tmp_path
    cases = qa.auto_find_bad_case([(x, torch.arange(4)) for x in data], num_steps=2, metric="L1")
    assert len(cases) == 8 and cases[0]["metric"] >= cases[-1]["metric"]  # L1: largest first
    results = qa.run()
    assert set(results) == {"compare_per_layer", "statistic", "weights", "sensitivity"}
    assert (tmp_path / "report.html").is_file()
    layers = [(r["layer"], r["sqnr"]) for r in results["compare_per_layer"]]
    only_conv = qa.compare_per_layer(prefixes=("conv",))
    assert [r["layer"] for r in only_conv] == ["conv"]
    ranked = [(r["name"], r["kind"]) for r in qa.sensitivity(metric="L1")]
    reverse = qa.sensitivity(metric="L1", reverse=True)
    assert [(r["name"], r["kind"]) for r in reverse] == ranked[::-1]
    assert [r["rank"] for r in reverse] == list(range(len(ranked)))
    # the same analysis in fxq's order and in the vendor's positional order
    for other in (
        QuantAnalysis(model, prepared, tmp_path / "fxq"),
        QuantAnalysis(model, prepared, "fake_quant", None, None, tmp_path / "vendor"),
    ):
        other.set_bad_case(qa.bad_case)
        assert [(r["layer"], r["sqnr"]) for r in other.compare_per_layer()] == layers
    custom = qa.auto_find_bad_case(
        data,
        metric="custom",
        custom_metric_func=lambda a, b: float((a - b).abs().max()),
        custom_metric_order_seq="descending",
    )
    assert custom[0]["metric"] == max(r["metric"] for r in custom)
    with pytest.raises(ValueError, match="metric='custom' needs custom_metric_func"):
        qa.auto_find_bad_case(data, metric="custom")
    with pytest.raises(TypeError, match=r"^QuantAnalysis.auto_find_bad_case: `batches` is one"):
        qa.auto_find_bad_case(data[0])


def test_featuremap_similarity_and_compare_weights_take_the_vendor_arguments(
    bayes, tmp_path, capsys
):
    model, prepared = _float(), _calibrated()
    x = _images()[0]
    expected = featuremap_similarity(model, prepared, x, similarity_func="cosine")
    capsys.readouterr()
    rows = featuremap_similarity(
        model, prepared, x, similarity_func="Cosine", threshold=2.0, devices=None, out_dir=tmp_path
    )
    assert [r["similarity"] for r in rows] == [r["similarity"] for r in expected]
    printed = capsys.readouterr().out
    assert printed.startswith(f"{len(rows)} layer(s) with cosine worse than 2.0:")
    assert (tmp_path / "similarity.txt").is_file()
    positional = featuremap_similarity(model, prepared, x, "Cosine", None, None, tmp_path / "p")
    assert [r["similarity"] for r in positional] == [r["similarity"] for r in expected]
    assert (tmp_path / "p" / "similarity.html").is_file()
    weights = compare_weights(
        model,
        prepared,
        similarity_func="Cosine",
        with_tensorboard=False,
        tensorboard_dir=None,
        out_dir=tmp_path / "w",
    )
    assert [r["similarity"] for r in weights] == [r["cosine"] for r in weights]
    assert (tmp_path / "w" / "weight_comparison.txt").is_file()
    assert [r["layer"] for r in compare_weights(model, prepared, "Cosine")] == [
        r["layer"] for r in weights
    ]
