"""Where a step begins: the forward hook that captures or seeds the generators (pure torch, no MPI)."""
import torch
from torch import nn

from ulfmtrain.training import rng


def test_a_container_never_called_itself_begins_the_step_at_its_members_forward() -> None:
    """A GAN's networks in one ModuleDict: the dict is never called, so the hook on it alone never fired (no RNG
    captured for a replacement: its dropout masks differed from the dead rank's); now each member's call fires."""
    model = nn.ModuleDict({"g": nn.Linear(2, 2), "d": nn.ModuleList([nn.Sequential(nn.Linear(2, 2), nn.ReLU())])})
    calls: list[nn.Module] = []
    rng.on_forward(model, calls.append)
    x = torch.zeros(1, 2)
    model["d"][0](x)
    model["g"](x)
    assert calls == [model["d"][0], model["g"]]      # each called member once, not the Linear inside d[0]


def test_a_model_with_its_own_forward_fires_once_per_call_not_per_layer() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    calls: list[nn.Module] = []
    rng.on_forward(model, calls.append)
    model(torch.zeros(1, 2))
    model[0](torch.zeros(1, 2))                      # a layer called on its own is not the model's forward
    assert calls == [model]
