"""QAT under FSDP2 (``torch.distributed.fsdp.fully_shard``) with distributed checkpoints.

Two gloo CPU processes, each with its own half of every batch, train a prepared
ResidualNet sharded with ``fully_shard``, save it with ``torch.distributed.checkpoint``
(DCP) and resume from it; one process without a process group loads the checkpoint
into a freshly prepared model and converts it. The integer model equals the one a single
process converts after the same training on the concatenated batches, bit for bit.

What makes the two runs the same computation:

* calibration and the QAT observers combine every rank's batch (``calibrate`` does it,
  and training runs inside ``fxq.observer.synchronized``): min / max reduced over the
  ranks are those of the whole batch, so the scales are the single process's, and every
  rank keeps the same buffers (FSDP2, unlike DDP, never broadcasts buffers);
* BatchNorm statistics are frozen (``freeze_bn_stats``): in training mode a BatchNorm
  normalises with its own rank's batch, which differs from the whole batch's statistics;
* FSDP averages the gradients over the ranks: the gradient of a single process's mean
  loss on the whole batch.

Float sums depend on their order: one sum over the whole batch against two sums over
the halves that the reduce-scatter adds. The models train in float64, so the weights
agree to about 1e-17 (the test allows 1e-14); every number the integer model is made of
is then rounded to a float32 statistic or scale or to an integer, which absorbs such a
difference unless a value lies within 1e-16 (relative) of a rounding boundary, a chance
below 1e-6 over all of this model's values. The scales and every other buffer,
and the integer model, are asserted equal bit for bit. (fxq's fake quants keep float32
scales in a float64 model, so the integer model is the one a float32 model gives.)

``dcp.load`` into a model prepared without ``offset_activations`` keeps the offsets (a
fake quant saves its offset, 0 included, so the fresh model's state dict has the key DCP
fills). VALIDATION under FSDP2 follows weights written in place after its first forward
(FSDP2 refills the unsharded parameters without a version bump; the integer twin is keyed
on the sharded ones).
"""

import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import fully_shard

import fxq
from fxq.calibration import calibrate, offset_activations
from fxq.observer import synchronized
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig
from tests.helpers import ResidualNet

WORLD = 2
PER_RANK = 4  # samples of each rank's batch
STEPS = 3
SHARDED = ("stem", "conv1", "conv2", "fc")  # fully_shard on each of them, then on the root
FULL = StateDictOptions(full_state_dict=True)


def _prepared(offset: bool = True) -> torch.fx.GraphModule:
    """The same QAT model on every rank and in every process (float64; see the docstring).

    ``offset``: store conv1's ReLU output on all 256 int8 levels (``offset_activations``),
    so the checkpoint holds a fake quant's ``offset`` as well as its scales.
    """
    fxq.set_march("bayes")
    torch.manual_seed(0)
    model = fxq.prepare_qat_fx(ResidualNet(), {"": default_qat_8bit_fake_quant_qconfig})
    if offset:
        assert offset_activations(model) == ["conv1"]
    return model.to(torch.float64)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch: images and labels; rank r trains on the r-th half."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(WORLD * PER_RANK, 3, 8, 8, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 10, (WORLD * PER_RANK,), generator=g)


def _probe() -> torch.Tensor:
    return torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def _start_qat(model: torch.nn.Module) -> None:
    fxq.set_fake_quantize(model, fxq.FakeQuantState.QAT)
    fxq.qat.freeze_bn_stats(model)  # batch statistics would be each rank's own
    model.train()


def _shard(model: torch.nn.Module) -> None:
    for name in SHARDED:
        fully_shard(model.get_submodule(name))
    fully_shard(model)


def _train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``STEPS`` SGD steps on the batch; the losses before each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def _validation(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    fxq.set_fake_quantize(model, fxq.FakeQuantState.VALIDATION)
    model.eval()
    with torch.no_grad():
        return model(x)


def _worker(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    try:
        model = _prepared()
        x, y = (t[rank * PER_RANK : (rank + 1) * PER_RANK] for t in _batch())
        calibrate(model, [x], show_progress=False)  # the observers combine the ranks' batches
        _start_qat(model)
        _shard(model)
        with synchronized(model):  # QAT's observers too: one set of scales
            losses = _train(model, x, y)
        sharded = get_model_state_dict(model)
        dcp.save(sharded, checkpoint_id=f"{tmp}/checkpoint")
        full = get_model_state_dict(model, options=FULL)  # a collective: every rank calls it
        validation = _validation(model, _probe())  # unsharded for the forward
        try:
            fxq.convert_fx(model)
            convert_error = ""
        except TypeError as e:
            convert_error = str(e)
        # resume: the same script's model, sharded, loads the checkpoint in place
        resumed = _prepared()
        _start_qat(resumed)
        _shard(resumed)
        state = get_model_state_dict(resumed)
        dcp.load(state, checkpoint_id=f"{tmp}/checkpoint")
        set_model_state_dict(resumed, state)
        torch.save(
            {
                "is_dtensor": type(sharded["conv1.weight"]).__name__ == "DTensor",
                "local_rows": sharded["conv1.weight"].to_local().shape[0],
                "losses": losses,
                "full": full,
                "resumed": get_model_state_dict(resumed, options=FULL),
                "validation": validation,
                "convert_error": convert_error,
            },
            f"{tmp}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def _single_process() -> torch.fx.GraphModule:
    """The same training in one process, on the whole batch."""
    model = _prepared()
    x, y = _batch()
    calibrate(model, [x], show_progress=False)
    _start_qat(model)
    _train(model, x, y)
    return model


def _assert_same_state(a: dict, b: dict, floats: set[str], atol: float = 0.0) -> None:
    """The same keys; the ``floats`` entries within ``atol``, the others bit for bit."""
    assert a.keys() == b.keys()
    for k in a:
        if k in floats:
            torch.testing.assert_close(a[k], b[k], rtol=0.0, atol=atol, msg=k)
        else:
            assert torch.equal(a[k], b[k]), k


def test_fsdp_qat_trains_checkpoints_and_converts_to_the_single_process_integer_model():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(WORLD, tmp), nprocs=WORLD, join=True)
        ranks = [torch.load(f"{tmp}/rank{r}.pt", weights_only=False) for r in range(WORLD)]
        # convert in this process, which has no process group: the checkpoint as a
        # torch.save file, loaded into a freshly prepared model (no offset_activations:
        # the state dict carries conv1's offset)
        assert not dist.is_initialized()
        dcp_to_torch_save(f"{tmp}/checkpoint", f"{tmp}/model.pt")
        loaded = _prepared(offset=False)
        loaded.load_state_dict(torch.load(f"{tmp}/model.pt", weights_only=True))

    parameters = {n for n, _ in loaded.named_parameters()}
    zero, one = ranks
    # sharded: each rank held half of conv1's 8 output channels as a DTensor
    assert zero["is_dtensor"] and zero["local_rows"] == one["local_rows"] == 4
    # it trained: the loss of the whole batch (the mean of the ranks' means) fell and
    # every parameter moved
    global_losses = (zero["losses"] + one["losses"]) / 2
    assert global_losses[-1] < global_losses[0] and len(global_losses) == STEPS
    start = _prepared().state_dict()
    assert all(not torch.equal(zero["full"][n], start[n]) for n in parameters)
    # one model on both ranks: averaged gradients, and scales from the combined statistics
    _assert_same_state(zero["full"], one["full"], parameters)
    # resuming from the checkpoint under FSDP gives back the model that was saved
    for r in ranks:
        _assert_same_state(r["resumed"], zero["full"], parameters)
    # the checkpoint holds the model that was trained, conv1's offset included
    assert loaded.get_submodule("conv1").activation_post_process.offset == 128
    _assert_same_state(loaded.state_dict(), zero["full"], parameters)

    # the single-process run: the same weights up to float summation order (1e-14 on
    # values of about 0.1), every scale and statistic bit for bit
    reference = _single_process()
    _assert_same_state(loaded.state_dict(), reference.state_dict(), parameters, atol=1e-14)

    # one integer model: the same integer weights, int32 biases, scales, multipliers and
    # shifts (the float64 folded biases they were rounded from, kept to requantize at a new
    # input scale, agree like the weights), and the same outputs; VALIDATION (on the loaded
    # model, and under FSDP on each rank) computes them
    fxq.set_fake_quantize(reference, fxq.FakeQuantState.VALIDATION)
    integer, expected = fxq.convert_fx(loaded), fxq.convert_fx(reference)
    state = integer.state_dict()
    float_biases = {k for k in state if k.endswith(".float_bias")}
    assert len(float_biases) == 4
    _assert_same_state(state, expected.state_dict(), float_biases, atol=1e-14)
    probe = _probe()
    out = integer(probe)
    assert torch.equal(out, expected(probe))
    assert torch.equal(_validation(loaded, probe), out)
    assert all(torch.equal(r["validation"], out) for r in ranks)
    # the sharded model itself is not converted: the error says how to get a full one
    assert all("full_state_dict=True" in r["convert_error"] for r in ranks)


def test_dcp_load_into_a_freshly_prepared_model_keeps_the_offset(tmp_path):
    saved = _prepared()
    calibrate(saved, [_batch()[0]], show_progress=False)
    dcp.save(get_model_state_dict(saved), checkpoint_id=tmp_path)
    fresh = _prepared(offset=False)  # as when converting in another program
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=tmp_path)
    set_model_state_dict(fresh, state)
    assert fresh.get_submodule("conv1").activation_post_process.offset == 128


def _new_weights_worker(rank: int, world: int, tmp: str) -> None:
    """VALIDATION, new weights written in place (as when averaged weights are swapped in
    for an evaluation), VALIDATION again; saves the second outputs and the full state."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    try:
        model = _prepared()
        calibrate(
            model, [_batch()[0][rank * PER_RANK : (rank + 1) * PER_RANK]], show_progress=False
        )
        _start_qat(model)
        _shard(model)
        before = _validation(model, _probe())
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        after = _validation(model, _probe())
        full = get_model_state_dict(model, options=FULL)
        torch.save({"before": before, "after": after, "full": full}, f"{tmp}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_validation_under_fsdp_follows_weights_written_in_place():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_new_weights_worker, args=(WORLD, tmp), nprocs=WORLD, join=True)
        ranks = [torch.load(f"{tmp}/rank{r}.pt", weights_only=False) for r in range(WORLD)]
    model = _prepared()
    model.load_state_dict(ranks[0]["full"])
    fxq.set_fake_quantize(model, fxq.FakeQuantState.VALIDATION)
    expected = fxq.convert_fx(model)(_probe())
    assert not torch.equal(ranks[0]["before"], expected)  # the weights did change
    assert all(torch.equal(r["after"], expected) for r in ranks)
