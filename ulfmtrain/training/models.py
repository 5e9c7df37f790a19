"""Models for 8x8 digits, a ResNet-18 for 32x32 images, and loading any torch.nn.Module by name."""
from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch import nn


def _dropout(p: float) -> nn.Module:
    # No parameters or buffers either way: a model's state_dict keys do not depend on p.
    return nn.Dropout(p) if p > 0 else nn.Identity()


class DigitsCNN(nn.Module):
    """A small CNN for 1x8x8 images (dropout: on the pooled features, as pytorch/examples' MNIST net)."""

    def __init__(self, classes: int = 10, dropout: float = 0.0) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.dropout = _dropout(dropout)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.features(x)))


class DigitsCNNBN(nn.Module):
    """The digits CNN with batch normalization: buffers (running statistics) every replica must share."""

    def __init__(self, classes: int = 10, dropout: float = 0.0) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.dropout = _dropout(dropout)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.features(x)))


class MLP(nn.Module):
    """A multi-layer perceptron over flattened inputs (dropout: on the last hidden layer's output)."""

    def __init__(self, inputs: int = 64, hidden: tuple[int, ...] = (128, 64), classes: int = 10,
                 dropout: float = 0.0) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        for h in hidden:
            layers += [nn.Linear(inputs, h), nn.ReLU()]
            inputs = h
        if dropout > 0:           # only then: the last layer's state_dict key moves by one
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(inputs, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch normalization and a shortcut (He et al., 2016)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 images (CIFAR-10 shape): a 3x3 stem without max-pooling, 11.2 M parameters."""

    def __init__(self, classes: int = 10, channels: int = 3, dropout: float = 0.0) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(channels, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64),
                                   nn.ReLU(inplace=True)]
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.features = nn.Sequential(*layers)
        self.dropout = _dropout(dropout)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.features(x)))


MODELS: dict[str, Callable[..., nn.Module]] = {"cnn": DigitsCNN, "cnn-bn": DigitsCNNBN, "mlp": MLP,
                                               "resnet18": ResNet18}


def build_model(name: str, inputs: int = 64, classes: int = 10, shape: tuple[int, ...] | None = None,
                dropout: float = 0.0) -> nn.Module:
    """Build 'cnn', 'cnn-bn', 'mlp', 'resnet18', or 'package.module:factory' (a callable returning an nn.Module).

    inputs: features per record (mlp); shape: a record's shape (resnet18 takes its channels); dropout: the
    built-in models' dropout probability before their classifier.
    """
    if name == "mlp":
        return MLP(inputs, classes=classes, dropout=dropout)
    if name == "resnet18":
        if shape is None or len(shape) != 3:
            raise ValueError(f"--model resnet18 needs images of shape (channels, height, width), got records of "
                             f"shape {shape}: make them with `data synthetic --shape 3,32,32` or convert arrays of "
                             "that shape")
        return ResNet18(classes, channels=shape[0], dropout=dropout)
    if name in MODELS:
        return MODELS[name](classes, dropout=dropout)
    module, sep, attr = name.partition(":")
    if not sep:
        raise ValueError(f"unknown model {name!r}: use {', '.join(MODELS)} or package.module:factory")
    if dropout:
        raise ValueError(f"--dropout {dropout:g} works with the built-in models, not {name!r}: put nn.Dropout "
                         "layers in your model factory instead")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load model {name!r} ({exc}): give an importable package.module:factory") from None
    model = factory()
    if not isinstance(model, nn.Module):
        raise ValueError(f"model factory {name!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def large_mlp() -> MLP:
    """A 6.3 M-parameter MLP over 1024 features (50 MB checkpoints): `--model ulfmtrain.training.models:large_mlp`."""
    return MLP(1024, hidden=(2048, 2048), classes=10)
