"""Calibration across ranks: two gloo processes, each on its own shard, reach
exactly the scales one process reaches on the concatenated batches."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fxq
from fxq.calibration import auto_calibrate, calibrate, ptq
from fxq.qconfig import get_default_qconfig

OBSERVERS = ("min_max", "moving_average", "percentile", "mse", "mean_min_max")


def _shards(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s batch at ``step``: different sizes and ranges per rank."""
    g = torch.Generator().manual_seed(10 * step + rank)
    size = (3 + rank, 3, 8, 8)
    return torch.randn(size, generator=g) * (1 + 2 * rank + step)


def _prepared(observer: str) -> torch.nn.Module:
    from tests.helpers import ResidualNet

    fxq.set_march("bayes")
    torch.manual_seed(0)  # the same model on every rank
    qconfig = get_default_qconfig(activation_observer=observer)
    return fxq.prepare_qat_fx(ResidualNet().eval(), {"": qconfig})


def _scales(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: m.scale.clone()
        for name, m in model.named_modules()
        if isinstance(m, fxq.FakeQuantize) and m.ch_axis is None
    }


def _best_candidates(batches: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The scales of ``ptq(method="best")``'s two candidate ranges, recorded in one pass (the
    percentile observers ride beside the per-sample mean ones)."""
    from fxq.calibration.observers import MeanMinMaxObserver, PercentileObserver
    from fxq.calibration.ptq import (
        _also_observed,
        _take_ranges,
        activation_quants,
        observers_swapped,
    )

    model = _prepared("min_max")
    quants = activation_quants(model)
    wide = [PercentileObserver() for _ in quants]
    with observers_swapped(quants, MeanMinMaxObserver), _also_observed(quants, wide):
        calibrate(model, batches, show_progress=False)
    mean = _scales(model)
    _take_ranges(quants, wide)
    return [mean, _scales(model)]


def _int16_choice(batches: list[torch.Tensor]) -> list[str]:
    """The activations ``mixed_precision`` gives int16, ranked on ``batches``."""
    from fxq.calibration import mixed_precision
    from tests.helpers import ResidualNet

    model = _prepared("min_max")
    calibrate(model, batches, show_progress=False)
    torch.manual_seed(0)
    float_model = ResidualNet().eval()
    qconfig_dict = mixed_precision(
        float_model, model, batches, int16_budget=0.34, min_gain_db=0.05, show=False
    )
    return sorted(qconfig_dict["module_name"])


def _learned_without_broadcast(batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Learned rounding on ``batches`` with the final broadcast of rank 0's model left out:
    the weights each rank learned by itself."""
    from unittest import mock

    from fxq.calibration import weight_reconstruction

    model = _prepared("min_max")
    calibrate(model, batches, show_progress=False)  # the same scales on every rank
    with mock.patch("fxq.calibration.reconstruction.keep_rank0_result", lambda model: None):
        weight_reconstruction(model, batches, iters=6, block_depth=1, show=False)
    return {k: v.clone() for k, v in model.named_parameters()}


def _worker(rank: int, world: int, init_file: str, out_dir: str, sync: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = {}
        for observer in OBSERVERS:
            model = _prepared(observer)
            calibrate(
                model, [_shards(s, rank) for s in range(3)], show_progress=False, sync_ranks=sync
            )
            result[observer] = _scales(model)
        result["best_candidates"] = _best_candidates([_shards(s, rank) for s in range(3)])
        for method in ("default", "best"):
            model = _prepared("min_max")
            options = {"iters": 4} if method == "best" else {}
            ptq(model, [_shards(s, rank) for s in range(3)], method, show_progress=False, **options)
            result[f"ptq_{method}"] = {k: v.clone() for k, v in model.state_dict().items()}
        result["mixed_precision"] = _int16_choice([_shards(s, rank) for s in range(3)])
        result["learned_alone"] = _learned_without_broadcast([_shards(s, rank) for s in range(3)])
        try:
            auto_calibrate(_prepared("min_max"), [_shards(0, rank)], show=False)
        except RuntimeError as e:
            result["auto_calibrate"] = str(e)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run(sync: bool) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), tmp, sync), nprocs=2, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]


@pytest.fixture(scope="module")
def synced() -> list[dict]:
    return _run(sync=True)


@pytest.mark.parametrize("observer", OBSERVERS)
def test_ranks_reach_the_scales_of_one_process_on_all_data(synced, observer):
    one = _prepared(observer)
    calibrate(
        one, [torch.cat([_shards(s, 0), _shards(s, 1)]) for s in range(3)], show_progress=False
    )
    expected = _scales(one)
    for rank in range(2):
        got = synced[rank][observer]
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected), (rank, observer)


def test_ranks_reach_the_candidate_ranges_of_best_of_one_process(synced):
    """Both of ``ptq(method="best")``'s candidates (the percentile one recorded beside the
    other, outside the model's own observers) are combined over the ranks."""
    one = _best_candidates([torch.cat([_shards(s, 0), _shards(s, 1)]) for s in range(3)])
    for rank in range(2):
        for got, expected in zip(synced[rank]["best_candidates"], one):
            assert got.keys() == expected.keys()
            assert all(torch.equal(got[k], expected[k]) for k in expected), rank
    assert any(not torch.equal(one[0][k], one[1][k]) for k in one[0])  # two different ranges


@pytest.mark.parametrize("method", ["default", "best"])
def test_ptq_leaves_every_rank_with_one_model(synced, method):
    """Bias correction and learned rounding work on each rank's own shard; the ranks end with
    rank 0's model, not one model per shard."""
    first, second = (synced[rank][f"ptq_{method}"] for rank in range(2))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first), [
        k for k in first if not torch.equal(first[k], second[k])
    ]


def test_mixed_precision_gives_every_rank_one_qconfig_dict(synced):
    """Each rank ranks on its own shard (their choices differ: below); all return rank 0's."""
    assert synced[0]["mixed_precision"] == synced[1]["mixed_precision"]
    assert len(synced[0]["mixed_precision"]) >= 1
    assert _int16_choice([_shards(s, 1) for s in range(3)]) != synced[0]["mixed_precision"]


def test_learned_rounding_averages_its_steps_over_the_ranks(synced):
    """Each rank draws from its own shard; the steps (and the check against nearest rounding)
    are averaged over the ranks, so every rank learns the same rounding even before rank 0's
    model is broadcast (without the averaging they differ)."""
    first, second = (synced[rank]["learned_alone"] for rank in range(2))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_auto_calibrate_refuses_several_ranks(synced):
    for rank in range(2):
        assert synced[rank]["auto_calibrate"].startswith(
            "auto_calibrate: each rank would choose its observers from its own batches"
        )
        assert "(2 ranks); run it in one process" in synced[rank]["auto_calibrate"]


def test_without_sync_each_rank_keeps_its_own_statistics():
    ranks = _run(sync=False)
    first = ranks[0]["min_max"]
    assert any(not torch.equal(first[k], ranks[1]["min_max"][k]) for k in first)


def test_outside_a_distributed_run_synchronized_changes_nothing(bayes):
    from fxq.observer import synchronized

    model = _prepared("min_max")
    with synchronized(model):
        assert all(
            m.sync_group is None
            for m in model.modules()
            if isinstance(m, fxq.observer.ObserverBase)
        )


# -- uneven or empty ranks: one clear error on every rank, never a hang ------------------------


def _generator(batches: list[torch.Tensor]):
    yield from batches  # no len(): the ranks agree batch by batch


def _uneven_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import datetime

    from fxq.calibration import bias_correction

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    three_or_two = [_shards(s, rank) for s in range(3 - rank)]  # rank 0: 3, rank 1: 2
    none_on_rank1 = [_shards(0, rank)] if rank == 0 else []
    cases = {
        "calibrate_uneven": lambda: calibrate(_prepared("min_max"), three_or_two),
        "calibrate_uneven_stream": lambda: calibrate(
            _prepared("min_max"), _generator(three_or_two)
        ),
        "calibrate_empty": lambda: calibrate(_prepared("min_max"), none_on_rank1),
        "calibrate_empty_stream": lambda: calibrate(
            _prepared("min_max"), _generator(none_on_rank1)
        ),
        "ptq_uneven": lambda: ptq(_prepared("min_max"), three_or_two, iters=2),
        "bias_correction_empty": lambda: bias_correction(
            calibrate(_prepared("min_max"), [_shards(0, rank)]), none_on_rank1
        ),
    }
    result = {}
    try:
        for name, run in cases.items():
            try:
                run()
                result[name] = "returned"
            except Exception as e:  # noqa: BLE001 - the message is what the test checks
                result[name] = f"{type(e).__name__}: {e}"
            dist.barrier()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def uneven() -> list[dict[str, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.spawn(
            _uneven_worker,
            args=(2, os.path.join(tmp, "init"), tmp),
            nprocs=2,
            join=False,
        )
        import time

        deadline = time.monotonic() + 300
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail("the ranks hung on uneven data")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]


UNEVEN = (
    "ValueError: calibrate: the ranks have different numbers of batches (rank 0: 3, rank 1: 2); "
    "every rank must run the same number, because each batch's statistics or steps are "
    "combined over the ranks. Give the ranks equal shards (DistributedSampler(drop_last=True)) "
    "or pass num_batches=2 on every rank, or calibrate with sync_ranks=False (each rank keeps "
    "its own statistics)."
)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("calibrate_uneven", UNEVEN + " Nothing was run"),
        (
            "calibrate_uneven_stream",
            UNEVEN.replace("rank 0: 3", "rank 0: at least 3")
            + " The 2 batch(es) every rank had were run",
        ),
        (
            "calibrate_empty",
            "ValueError: calibrate: rank(s) [1] of 2 have no batch (batches per rank: rank 0: 1, "
            "rank 1: 0); every rank must have batches. Give each rank a non-empty shard (e.g. "
            "DistributedSampler with at least as many batches as ranks). Nothing was run",
        ),
        (
            "calibrate_empty_stream",
            "ValueError: calibrate: rank(s) [1] of 2 have no batch (batches per rank: rank 0: "
            "at least 1, rank 1: 0); every rank must have batches.",
        ),
        (
            "ptq_uneven",
            UNEVEN.replace("calibrate: the", "ptq: the").split(", or calibrate")[0]
            + ". Nothing was run",
        ),
        (
            "bias_correction_empty",
            "ValueError: bias_correction: rank(s) [1] of 2 have no batch (batches per rank: "
            "rank 0: 1, rank 1: 0)",
        ),
    ],
)
def test_uneven_or_empty_ranks_fail_together_with_one_message(uneven, case, expected):
    """Every rank raises the same error before any statistic is combined: no rank returns
    with partial statistics, none waits for a peer that gave up."""
    assert uneven[0][case] == uneven[1][case]
    assert uneven[0][case].startswith(expected), uneven[0][case]
