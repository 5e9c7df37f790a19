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
    assert calls == [model["d"][0], model["d"][0][0], model["d"][0][1], model["g"]]


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.enc(x))


def test_a_model_whose_loop_calls_its_parts_not_its_forward_still_begins_each_step() -> None:
    """`vae.dec(vae.enc(x))` (or `model.encode(x)`): the model's own forward is never called; before, only it was
    hooked, so seed= did nothing and a spare redid the step with the generators as they were at the hand-over."""
    vae, other = VAE(), nn.Linear(2, 2)
    calls: list[nn.Module] = []
    rng.on_forward(vae, calls.append)
    x = torch.zeros(1, 2)
    vae.dec(vae.enc(x))
    other(x)                                         # a module outside the model is no step of it
    assert calls == [vae.enc, vae.dec]
    calls.clear()
    vae(x)
    assert calls == [vae, vae.enc, vae.dec]          # the first of them begins the step (fn acts once a step)
