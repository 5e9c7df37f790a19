"""Models for 8x8 digits, and loading any torch.nn.Module by name."""
from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """A small CNN for 1x8x8 images."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class DigitsCNNBN(nn.Module):
    """The digits CNN with batch normalization: buffers (running statistics) every replica must share."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class MLP(nn.Module):
    """A multi-layer perceptron over flattened inputs."""

    def __init__(self, inputs: int = 64, hidden: tuple[int, ...] = (128, 64), classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        for h in hidden:
            layers += [nn.Linear(inputs, h), nn.ReLU()]
            inputs = h
        layers.append(nn.Linear(inputs, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


MODELS: dict[str, Callable[..., nn.Module]] = {"cnn": DigitsCNN, "cnn-bn": DigitsCNNBN, "mlp": MLP}


def build_model(name: str, inputs: int = 64, classes: int = 10) -> nn.Module:
    """Build 'cnn', 'cnn-bn', 'mlp', or 'package.module:factory' (a callable returning an nn.Module)."""
    if name == "mlp":
        return MLP(inputs, classes=classes)
    if name in MODELS:
        return MODELS[name](classes)
    module, sep, attr = name.partition(":")
    if not sep:
        raise ValueError(f"unknown model {name!r}: use {', '.join(MODELS)} or package.module:factory")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load model {name!r} ({exc}): give an importable package.module:factory") from None
    model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"model factory {name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def large_mlp() -> MLP:
    """A 6.3 M-parameter MLP over 1024 features (50 MB checkpoints): `--model ulfmtrain.models:large_mlp`."""
    return MLP(1024, hidden=(2048, 2048), classes=10)
