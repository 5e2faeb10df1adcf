"""``fxq.export.load`` reads untrusted files safely: sizes before reading, ``.npy`` headers before
data, no pickle, the JSON schema and every node against its op; every failure is an
``IntegerGraphFormatError`` naming the file and the member or node (``docs/integer_graph.md``, 1)."""

from __future__ import annotations

import io
import json
import pickle
import struct
import tracemalloc
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import fxq
import fxq.export
from fxq.export import IntegerGraphFormatError
from fxq.export.validate import MARCH_LIMITS


class _Small(nn.Module):
    """conv, relu, a table, average pooling, linear: quantize .. dequantize."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.dq = fxq.QuantStub(), fxq.DeQuantStub()
        self.conv, self.pool = nn.Conv2d(3, 4, 3), nn.AvgPool2d(2)
        self.linear = nn.Linear(144, 5)

    def forward(self, x):
        x = torch.sigmoid(torch.relu(self.conv(self.q(x))))
        return self.dq(self.linear(self.pool(x).flatten(1)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[bytes, np.ndarray, list[np.ndarray]]:
    """A saved small graph (its bytes), an input and the graph's outputs on it."""
    fxq.set_march("bayes")
    qat = fxq.prepare_qat_fx(_Small().eval(), {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig})
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad():
        qat(torch.randn(2, 3, 14, 14))
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        integer = fxq.convert_fx(qat)
    x = torch.randn(2, 3, 14, 14)
    graph = fxq.export.to_graph(integer, x)
    path = tmp_path_factory.mktemp("saved") / "g.fxq"
    graph.save(path)
    return path.read_bytes(), x.numpy(), graph.run(x.numpy())


class _Masked(nn.Module):
    """A version-2 graph: an int64 mask input, a cast, a comparison, a logical op, ``where``."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.dq = fxq.QuantStub(), fxq.DeQuantStub()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, mask):
        y = self.dq(self.linear(self.q(x)))
        return y.masked_fill(~(mask.bool() & (mask < 5))[:, :, None], 0.0)


@pytest.fixture(scope="module")
def saved_masks(tmp_path_factory) -> tuple[bytes, tuple, list[np.ndarray]]:
    """``saved`` for a version-2 graph (its inputs: a float tensor and an int64 mask)."""
    fxq.set_march("bayes")
    x, mask = torch.randn(2, 3, 4), torch.tensor([[1, 1, 0], [1, 0, 0]])
    qat = fxq.prepare_qat_fx(
        _Masked().eval(), {"": fxq.qconfig.default_qat_8bit_fake_quant_qconfig}
    )
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad():
        qat(x, mask)
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = fxq.export.to_graph(fxq.convert_fx(qat), (x, mask))
    assert graph.format_version() == 2
    path = tmp_path_factory.mktemp("saved_masks") / "g.fxq"
    graph.save(path)
    return path.read_bytes(), (x.numpy(), mask.numpy()), graph.run(x.numpy(), mask.numpy())


class _FloatRegion(nn.Module):
    """A version-3 graph: a float region (qconfig None) of a conv, a BatchNorm, a ReLU, an
    average pooling and a LayerNorm between integer convs, and a float softmax tail."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.dq = fxq.QuantStub(), fxq.DeQuantStub()
        self.conv = nn.Conv2d(3, 4, 3)
        self.region = nn.Sequential(
            nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AvgPool2d(2),
            nn.LayerNorm(3),
        )  # fmt: skip
        self.linear = nn.Linear(36, 5)

    def forward(self, x):
        x = self.region(self.conv(self.q(x)))
        return self.dq(self.linear(x.flatten(1))).softmax(-1)


@pytest.fixture(scope="module")
def saved_float(tmp_path_factory) -> tuple[bytes, np.ndarray, list[np.ndarray]]:
    """``saved`` for a version-3 graph (float ops of a float region and a float tail)."""
    fxq.set_march("bayes")
    qconfig = {
        "": fxq.qconfig.default_qat_8bit_fake_quant_qconfig,
        "module_name": {"region": None},
        "module_type": {"softmax": None},
    }
    qat = fxq.prepare_qat_fx(_FloatRegion().eval(), qconfig)
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.CALIBRATION)
    with torch.no_grad():
        qat(torch.randn(2, 3, 8, 8))
    fxq.set_fake_quantize(qat, fxq.FakeQuantState.VALIDATION)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = fxq.export.to_graph(fxq.convert_fx(qat), torch.randn(2, 3, 8, 8))
    assert graph.format_version() == 3
    path = tmp_path_factory.mktemp("saved_float") / "g.fxq"
    graph.save(path)
    x = torch.randn(2, 3, 8, 8).numpy()
    return path.read_bytes(), x, graph.run(x)


def _members(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {n: z.read(n) for n in z.namelist()}


def _zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


def _edit(data: bytes, fn) -> bytes:
    """The file with ``graph.json`` replaced by ``fn(meta)`` (which edits it in place)."""
    members = _members(data)
    meta = json.loads(members["graph.json"])
    fn(meta)
    members["graph.json"] = json.dumps(meta).encode()
    return _zip(members)


def _node(meta: dict, op: str) -> dict:
    return next(n for n in meta["nodes"] if n["op"] == op)


def _npy(array: np.ndarray, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=allow_pickle)
    return buf.getvalue()


def _with_param(data: bytes, op: str, param: str, array_bytes: bytes) -> bytes:
    members = _members(data)
    meta = json.loads(members["graph.json"])
    members[_node(meta, op)["params"][param]] = array_bytes
    return _zip(members)


def _write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "g.fxq"
    path.write_bytes(data)
    return path


def _refused(tmp_path: Path, data: bytes, match: str, **kwargs: Any) -> str:
    path = _write(tmp_path, data)
    with pytest.raises(IntegerGraphFormatError, match=match) as e:
        fxq.export.load(path, **kwargs)
    message = str(e.value)
    assert message.startswith(str(path)) and "allow_pickle" not in message
    return message


def test_a_saved_version_1_file_loads_and_runs_as_saved(saved, tmp_path):
    data, x, expected = saved
    assert json.loads(_members(data)["graph.json"])["version"] == 1
    got = fxq.export.load(_write(tmp_path, data)).run(x)
    assert all(np.array_equal(e, g) for e, g in zip(expected, got))


def test_a_huge_declared_npy_shape_is_refused_before_any_allocation(saved, tmp_path):
    data, _, _ = saved
    header = {"descr": "<i4", "fortran_order": False, "shape": (70_000_000,)}  # 280 MB
    text = repr(header).encode("latin1")
    text += b" " * (63 - (10 + len(text)) % 64) + b"\n"
    crafted = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + b"\0" * 64
    path = _write(tmp_path, _with_param(data, "conv", "bias", crafted))
    tracemalloc.start()
    try:
        with pytest.raises(
            IntegerGraphFormatError,
            match=r"member 'params/\w+/bias\.npy' is not a plain \.npy array: shape \[70000000\] "
            r"of int32 needs 280000000 bytes, the member holds 64",
        ):
            fxq.export.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def test_member_sizes_are_checked_against_the_limit_before_reading(saved, tmp_path):
    data, _, _ = saved
    members = _members(data)
    members["params/extra/zeros.npy"] = _npy(np.zeros(1 << 18, np.int64))  # 2 MiB, ~2 KiB zipped
    message = _refused(
        tmp_path,
        _zip(members),
        r"member 'params/extra/zeros\.npy' declares 2097280 bytes, which takes the file's "
        r"contents above the limit of 1048576 bytes; if you trust the file, pass a larger "
        r"max_bytes to fxq\.export\.load$",
        max_bytes=1 << 20,
    )
    assert "2097280" in message


def test_the_default_limit_refuses_a_member_declaring_gigabytes(saved, tmp_path):
    data, _, _ = saved
    # the central directory entry of graph.json claims 4 GiB (uncompressed size at offset 24)
    at = data.index(b"PK\x01\x02")
    crafted = data[: at + 24] + struct.pack("<I", 0xFFFFFF00) + data[at + 28 :]
    _refused(
        tmp_path,
        crafted,
        r"declares 4294967040 bytes, which takes the file's contents above the limit of "
        r"1073741824 bytes",
    )
    assert fxq.export.validate.DEFAULT_MAX_BYTES == 1 << 30


def test_an_object_array_is_refused_without_unpickling_or_advising_allow_pickle(
    saved, tmp_path, monkeypatch
):
    data, _, _ = saved
    pickled = _npy(np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("pickle.load called"))
    _refused(
        tmp_path,
        _with_param(data, "conv", "weight", pickled),
        r"member 'params/\w+/weight\.npy' is not a plain \.npy array: dtype '\|O' \(arrays are "
        r"bool, int8, int16, int32, int64, float32, float64\)",
    )


def test_a_header_too_long_for_numpy_is_refused_without_advising_allow_pickle(saved, tmp_path):
    data, _, _ = saved
    text = repr({"descr": "<i4", "fortran_order": False, "shape": (1,)}) + " " * 20000 + "\n"
    crafted = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode() + b"\0" * 4
    _refused(
        tmp_path,
        _with_param(data, "conv", "bias", crafted),
        r"is not a plain \.npy array: a header of 20\d\d\d bytes",
    )


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda m: m.update(nodes="conv"), r"graph\.json: 'nodes' is str, expected list"),
        (lambda m: m.pop("tensors"), r"graph\.json: no key 'tensors'"),
        (lambda m: m.update(version="1"), r"graph\.json: version '1' is not a positive integer"),
        (
            lambda m: m.update(version=5),
            r"integer graph version 5 is newer than this fxq reads \(4\); upgrade fxq$",
        ),
        (lambda m: m.update(format="onnx"), r"not an fxq integer graph \(format 'onnx'"),
        (lambda m: m["nodes"].__setitem__(0, 7), r"graph\.json: nodes\[0\] is int, not an object"),
        (
            lambda m: _node(m, "conv").update(op="fft"),
            r"node '\w+' has op 'fft', which this fxq does not run \(ops: .*\); upgrade fxq",
        ),
        (
            lambda m: _node(m, "conv")["attrs"].update(stride="1"),
            r"node '\w+' \(op 'conv'\): attribute 'stride' is '1', expected a list of integers",
        ),
        (
            lambda m: _node(m, "quantize")["attrs"].update(scale=None),
            r"attribute 'scale' is None, expected a finite number",
        ),
        (
            lambda m: m["tensors"][m["inputs"][0]].update(shape=[-2, 3]),
            r"tensor '\w+' has shape \[-2, 3\] \(sizes >= 0 or symbols such as 'N'\)",
        ),
        (
            lambda m: _node(m, "linear")["inputs"].__setitem__(0, "nowhere"),
            r"node '\w+' reads 'nowhere', which no earlier node or graph input makes",
        ),
        (
            lambda m: _node(m, "axis_matmul")["attrs"].update(axes=[7]),
            r"\(op 'axis_matmul'\): axes\[0\] 7 is not an axis of a rank-4 input",
        ),
        (
            lambda m: _node(m, "requantize")["attrs"].update(rounding="up"),
            r"attribute 'rounding' is 'up', expected one of \['half_up', 'half_even'\]",
        ),
        (
            lambda m: m.update(march="pentium"),
            r"graph\.json: unknown march 'pentium' \(known: bernoulli2, bayes, bayes-e\)",
        ),
    ],
)
def test_schema_violations_name_the_file_and_the_key_or_node(saved, tmp_path, edit, match):
    data, _, _ = saved
    _refused(tmp_path, _edit(data, edit), match)


@pytest.mark.parametrize(
    ("op", "param", "array", "match"),
    [
        (
            "conv",
            "shift",
            np.full(4, 40, np.int32),
            r"\(op 'conv'\): param 'shift' holds 40\.\.40, outside march bayes's shifts -31\.\.31",
        ),
        (
            "linear",
            "multiplier",
            np.full(5, 1 << 20, np.int32),
            r"\(op 'linear'\): param 'multiplier' holds 1048576 in magnitude, wider than march "
            r"bayes's multipliers \(at most 32767\)",
        ),
        (
            "lut",
            "table",
            np.zeros(100, np.int8),
            r"\(op 'lut'\): param 'table' has 100 entries, expected 256",
        ),
        (
            "conv",
            "weight",
            np.zeros((4, 3, 3, 3), np.float32),
            r"member 'params/\w+/weight\.npy' \(node '\w+', op 'conv', param 'weight'\) is float32 "
            r"of shape \[4, 3, 3, 3\], expected int8",
        ),
        (
            "conv",
            "weight",
            np.zeros((4, 27), np.int8),
            r"\(op 'conv'\): dim 2 with a rank-2 weight",
        ),
        (
            "linear",
            "weight",
            np.zeros((5, 30), np.int8),
            r"\(op 'linear'\): an input of shape \['N', 144\] for a weight of shape \[5, 30\]",
        ),
    ],
)
def test_arrays_and_ranges_are_checked_against_the_op(saved, tmp_path, op, param, array, match):
    data, _, _ = saved
    _refused(tmp_path, _with_param(data, op, param, _npy(array)), match)


def test_a_missing_member_is_named(saved, tmp_path):
    data, _, _ = saved
    members = _members(data)
    meta = json.loads(members["graph.json"])
    del members[_node(meta, "lut")["params"]["table"]]
    _refused(
        tmp_path,
        _zip(members),
        r"\(op 'lut'\): param 'table' names member 'params/\w+/table\.npy', which the file does "
        r"not hold",
    )


def test_a_truncated_file_is_a_format_error(saved, tmp_path):
    data, _, _ = saved
    _refused(tmp_path, data[: len(data) // 2], r"not a readable fxq integer graph")


def test_march_limits_are_the_march_specs():
    from fxq.march import MARCH_SPECS

    assert {
        m.value: (s.multiplier_bits, s.shift_range[1]) for m, s in MARCH_SPECS.items()
    } == MARCH_LIMITS
    assert all(s.shift_range[0] == 0 for s in MARCH_SPECS.values())


# -- fuzzing ---------------------------------------------------------------------------------------
_WRONG = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.just([]),
    st.just({}),
    st.just([[1, 2]] * 3),
    st.just(["N", -1]),
)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) to a value inside ``value``."""
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def _damaged(draw, data: bytes) -> bytes:
    kind = draw(st.sampled_from(["truncate", "flip", "remove", "rename", "json", "npy", "shape"]))
    if kind == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    if kind == "flip":
        out = bytearray(data)
        for i in draw(st.lists(st.integers(0, len(data) - 1), min_size=1, max_size=8)):
            out[i] ^= draw(st.integers(1, 255))
        return bytes(out)
    members = _members(data)
    names = sorted(members)
    if kind in ("remove", "rename"):
        name = draw(st.sampled_from(names))
        value = members.pop(name)
        if kind == "rename":
            members[draw(st.sampled_from([*names, "x.npy", "params/a/b.npy", "../up.npy"]))] = value
        return _zip(members)
    if kind == "json":
        meta = json.loads(members["graph.json"])
        path = draw(st.sampled_from(_paths(meta)))
        parent = meta
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = draw(_WRONG)
        members["graph.json"] = json.dumps(meta).encode()
        return _zip(members)
    name = draw(st.sampled_from([n for n in names if n.endswith(".npy")]))
    if kind == "npy":  # another dtype / rank in the same member
        dtype = draw(st.sampled_from(["int8", "int32", "int64", "float32", "bool", "uint8", "<U2"]))
        shape = draw(st.lists(st.integers(0, 4), max_size=4))
        members[name] = _npy(np.zeros(shape, dtype))
    else:  # a huge declared shape over the member's data
        dims = draw(st.lists(st.integers(0, 2**40), min_size=1, max_size=4))
        text = repr({"descr": "<i8", "fortran_order": False, "shape": tuple(dims)})
        members[name] = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode() + b"\0"
    return _zip(members)


@pytest.mark.parametrize("file", ["saved", "saved_masks", "saved_float"])
def test_damaged_files_load_or_raise_only_the_format_error(file, request, tmp_path_factory):
    data, _, _ = request.getfixturevalue(file)
    folder = tmp_path_factory.mktemp("fuzz")
    path = folder / "g.fxq"
    calls: list[str] = []

    def forbidden(name: str):
        def call(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} called while loading")

        return call

    @settings(
        max_examples=200,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(_damaged(data))
    def check(damaged: bytes) -> None:
        path.write_bytes(damaged)
        try:
            graph = fxq.export.load(path)
        except IntegerGraphFormatError as e:
            assert "allow_pickle" not in str(e) and str(path) in str(e)
        else:
            assert isinstance(graph, fxq.export.IntegerGraph)
        assert sorted(p.name for p in folder.iterdir()) == ["g.fxq"]  # nothing written

    with pytest.MonkeyPatch.context() as mp:
        for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler")):
            mp.setattr(module, name, forbidden(f"pickle.{name}"))
        import os
        import subprocess

        mp.setattr(os, "system", forbidden("os.system"))
        mp.setattr(subprocess, "Popen", forbidden("subprocess.Popen"))
        check()
    assert calls == []
