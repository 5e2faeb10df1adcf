"""``benchmarks/qat_speed.py`` times only steps that train: a step that leaves a weight
without gradient (as torch 2.11 compiled fxq's QAT steps before their fake quants computed
out of place) stops the benchmark instead of printing a time."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def qat_speed(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    yield importlib.import_module("qat_speed")
    sys.modules.pop("qat_speed", None)


class _Cut(nn.Module):
    """A conv whose output the loss never sees (its weight's gradient is 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(3, 10)

    def forward(self, x):
        return self.head(x.mean((2, 3))) + 0.0 * self.conv(x).sum()


def test_a_step_whose_weights_get_no_gradient_is_not_timed(qat_speed):
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([1, 7])
    trains = qat_speed.step_fn(
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(10)), x, y
    )
    cut = qat_speed.step_fn(_Cut(), x, y)
    times = qat_speed.measure({"trains": trains}, iters=1, warmup=1, device=x.device)
    assert set(times) == {"trains"} and times["trains"] > 0
    with pytest.raises(
        SystemExit, match=r"cut: 1 weights got no gradient in a step \(first: \['conv.weight'\]\)"
    ):
        qat_speed.measure({"cut": cut}, iters=1, warmup=1, device=x.device)
