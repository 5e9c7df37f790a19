"""A model factory for `train --model drifting_model:build` whose replicas drift apart: each rank nudges a bias
by its own amount in every training forward, outside the optimizer (a user's bug that nothing reduces)."""
import os

import torch
from torch import nn


class Drifting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.net[1].bias.add_(1e-3 * int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
        return self.net(x)


def build() -> nn.Module:
    return Drifting()
