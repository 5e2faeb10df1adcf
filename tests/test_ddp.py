"""QAT under DistributedDataParallel: two processes, different data per rank.

Two CPU processes with gloo always; two GPUs with NCCL when the machine has them.
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import fxq
from fxq.calibration import calibrate
from fxq.qconfig import default_qat_8bit_fake_quant_qconfig


def _worker(rank: int, world: int, init_file: str, out_dir: str, backend: str) -> None:
    from tests.helpers import ResidualNet

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fxq.set_march("bayes")
        torch.manual_seed(0)  # the same model on every rank
        prepared = fxq.prepare_qat_fx(ResidualNet(), {"": default_qat_8bit_fake_quant_qconfig})
        prepared.to(device)
        torch.manual_seed(100 + rank)  # different data on every rank
        x = (torch.randn(8, 3, 8, 8) * (1 + rank)).to(device)
        calibrate(prepared, [x], show_progress=False)
        fxq.set_fake_quantize(prepared, fxq.FakeQuantState.QAT)
        prepared.train()
        ddp = DistributedDataParallel(
            prepared, device_ids=[rank] if device.type == "cuda" else None
        )
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        labels = torch.zeros(8, dtype=torch.long, device=device)
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), labels).backward()
            opt.step()
        fxq.set_fake_quantize(prepared, fxq.FakeQuantState.VALIDATION)
        ddp.eval()
        with torch.no_grad():
            ddp(
                x
            )  # a forward broadcasts rank 0's buffers; in eval / VALIDATION nothing updates them
            exact = torch.equal(fxq.convert_fx(prepared)(x), prepared(x))
        state = {k: v.cpu() for k, v in prepared.state_dict().items()}
        torch.save(
            {"state": state, "exact": exact},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        pytest.param(
            "nccl",
            marks=pytest.mark.skipif(
                torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available(),
                reason="needs two GPUs and NCCL",
            ),
        ),
    ],
)
def test_qat_under_ddp(backend):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), tmp, backend), nprocs=2, join=True)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    assert all(r["exact"] for r in ranks)  # each rank's integer model equals its VALIDATION output
    a, b = (r["state"] for r in ranks)
    assert a.keys() == b.keys()
    # gradients are averaged: the weights stay identical across ranks
    assert torch.equal(a["conv2.weight"], b["conv2.weight"]) and torch.equal(
        a["fc.weight"], b["fc.weight"]
    )
    # buffers (BatchNorm statistics, observer ranges, scales) come from rank 0
    assert torch.equal(a["conv1.bn.running_mean"], b["conv1.bn.running_mean"])
    assert torch.equal(
        a["x_quant.activation_post_process.scale"], b["x_quant.activation_post_process.scale"]
    )
