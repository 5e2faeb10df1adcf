import pytest
import torch

import fxq.march as march_module


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
