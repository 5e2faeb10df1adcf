import os

import pytest
import torch

import fxq.march as march_module

# pytest-xdist's workers share the machine's cores: each takes its share of torch's threads
# (two workers with two threads each on two cores made every test slower than one worker).
# The processes a test starts inherit the share, so that a float model computes the same
# bits there as in the test (a convolution's sums are split by thread).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)


@pytest.fixture(autouse=True)
def _isolate_global_state():
    """Every test starts with no march set and a fixed seed; the march is restored after."""
    saved = march_module._global_march
    march_module._global_march = None
    torch.manual_seed(0)
    yield
    march_module._global_march = saved


@pytest.fixture
def bayes():
    march_module.set_march("bayes")
    return march_module.get_march_spec()


@pytest.fixture
def layer_by_layer(monkeypatch):
    """Layer-by-layer algorithms re-run the model up to each layer (forward hooks) instead of
    streaming it once: the reference that the streamed runs must equal."""
    import fxq.calibration.reconstruction as reconstruction

    real_init = reconstruction._Sources.__init__

    def hooks_only(self, *args):
        real_init(self, *args)
        self.streams = None

    monkeypatch.setattr(reconstruction._Sources, "__init__", hooks_only)
