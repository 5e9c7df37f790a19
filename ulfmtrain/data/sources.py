"""Converters into ``.ulfmds`` files: scikit-learn's digits, in-memory arrays, and a large synthetic set."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..core.extras import require
from .format import split_path
from .writer import write_dataset, write_dataset_chunks

__all__ = ["digits_to_dataset", "arrays_to_dataset", "records_for_bytes", "synthetic_dataset"]

# Synthetic data is generated in fixed blocks of records, each from its own
# seeded generator, so the content does not depend on the chunk size used to
# write it.
_SYNTH_BLOCK = 1024


def digits_to_dataset(
    out_dir: str | os.PathLike[str], test_fraction: float = 0.2, seed: int = 0
) -> tuple[Path, Path]:
    """Convert scikit-learn's bundled digits into ``train.ulfmds`` and ``test.ulfmds`` under ``out_dir``.

    ``x`` is float32 of shape (1, 8, 8) scaled to [0, 1]; ``y`` is int64.  The
    split is a stratified shuffle with ``seed``.

    Returns:
        The train and test file paths.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    # Imported here so reading datasets never pays for (or needs) scikit-learn.
    load_digits = require("sklearn.datasets", "the digits dataset").load_digits
    train_test_split = require("sklearn.model_selection", "the digits dataset").train_test_split

    digits = load_digits()
    x = (digits.data.astype(np.float32) / np.float32(16.0)).reshape(-1, 1, 8, 8)
    y = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, shuffle=True, stratify=y
    )
    out = Path(out_dir)
    base = {"source": "sklearn.load_digits", "classes": 10, "seed": seed, "test_fraction": test_fraction}
    train, test = split_path(out, "train"), split_path(out, "test")
    write_dataset(train, {"x": x_tr, "y": y_tr}, {**base, "split": "train"})
    write_dataset(test, {"x": x_te, "y": y_te}, {**base, "split": "test"})
    return train, test


def arrays_to_dataset(
    out_dir: str | os.PathLike[str],
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray | None = None,
    y_test: np.ndarray | None = None,
    meta: Mapping[str, Any] | None = None,
) -> tuple[Path, Path | None]:
    """Write in-memory ``x``/``y`` arrays as ``train.ulfmds`` (and ``test.ulfmds``) under ``out_dir``.

    Dtypes are stored as given.  If ``meta`` lacks ``classes`` and the labels are
    integers, ``classes`` is set to ``max(label) + 1``.

    Returns:
        The train path and the test path (None when no test arrays were given).
    """
    if (x_test is None) != (y_test is None):
        raise ValueError("give both x_test and y_test, or neither")
    info: dict[str, Any] = {"source": "arrays", **(dict(meta) if meta else {})}
    labels = [np.asarray(y_train)] + ([np.asarray(y_test)] if y_test is not None else [])
    if "classes" not in info and all(np.issubdtype(lab.dtype, np.integer) for lab in labels):
        sizes = [lab.size for lab in labels]
        if sum(sizes):
            info["classes"] = int(max(int(lab.max()) for lab in labels if lab.size)) + 1
    out = Path(out_dir)
    train = split_path(out, "train")
    write_dataset(train, {"x": x_train, "y": y_train}, {**info, "split": "train"})
    test = None
    if x_test is not None:
        test = split_path(out, "test")
        write_dataset(test, {"x": x_test, "y": y_test}, {**info, "split": "test"})  # type: ignore[dict-item]
    return train, test


def records_for_bytes(total_bytes: int, features: int = 1024) -> int:
    """Return how many synthetic records of ``features`` float32 values fill ``total_bytes`` (rounded up)."""
    if total_bytes < 0 or features < 1:
        raise ValueError(f"need total_bytes >= 0 and features >= 1, got {total_bytes}, {features}")
    return -(-int(total_bytes) // (4 * int(features)))


def _synthetic_means(features: int, classes: int, seed: int) -> np.ndarray:
    """Return the per-class mean vectors of the synthetic set."""
    # Scaling by 1/sqrt(features) keeps the distance between class means (about
    # 5.7 noise standard deviations) independent of the feature count, so the
    # task is learnable but not separable by any single feature.
    rng = np.random.default_rng([seed, 0])
    return (rng.standard_normal((classes, features)) * (4.0 / math.sqrt(features))).astype(np.float32)


def _synthetic_block(block: int, means: np.ndarray, seed: int, records: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (x, y) of synthetic block ``block``, truncated to ``records`` total records."""
    lo = block * _SYNTH_BLOCK
    n = min(_SYNTH_BLOCK, records - lo)
    rng = np.random.default_rng([seed, 1, block])
    classes, features = means.shape
    y = rng.integers(0, classes, size=n, dtype=np.int64)
    x = rng.standard_normal((n, features), dtype=np.float32)
    x += means[y]
    return x, y


def synthetic_dataset(
    path: str | os.PathLike[str],
    records: int,
    features: int = 1024,
    classes: int = 10,
    seed: int = 0,
    chunk_records: int = 8192,
    shape: tuple[int, ...] | None = None,
) -> Path:
    """Write a learnable synthetic classification set (Gaussian classes) in bounded-memory chunks.

    ``x`` is float32 of shape ``(features,)`` drawn around a class-dependent mean,
    ``y`` is int64 in ``[0, classes)``.  The content depends only on ``records``,
    ``features``, ``classes`` and ``seed``, not on ``chunk_records``.  With
    ``shape`` (e.g. ``(3, 32, 32)``, CIFAR-10's) records are stored in that
    shape and ``features`` is its product.

    Returns:
        The written path.
    """
    if shape is not None:
        if not shape or any(d < 1 for d in shape):
            raise ValueError(f"need a shape of positive dimensions, got {shape}")
        features = math.prod(shape)
    if records < 0 or features < 1 or classes < 1 or chunk_records < 1 or seed < 0:
        raise ValueError(
            "need records >= 0, features >= 1, classes >= 1, chunk_records >= 1, seed >= 0; got "
            f"{records}, {features}, {classes}, {chunk_records}, {seed}"
        )
    means = _synthetic_means(features, classes, seed)

    def chunks() -> Iterator[dict[str, np.ndarray]]:
        # Each chunk covers [lo, hi); it is assembled from the fixed-size blocks
        # overlapping it so the bytes are the same for any chunk size.
        for lo in range(0, records, chunk_records):
            hi = min(records, lo + chunk_records)
            xs, ys = [], []
            for block in range(lo // _SYNTH_BLOCK, (hi - 1) // _SYNTH_BLOCK + 1):
                bx, by = _synthetic_block(block, means, seed, records)
                a = max(lo, block * _SYNTH_BLOCK) - block * _SYNTH_BLOCK
                b = min(hi, (block + 1) * _SYNTH_BLOCK) - block * _SYNTH_BLOCK
                xs.append(bx[a:b])
                ys.append(by[a:b])
            x = np.concatenate(xs)
            yield {"x": x.reshape(len(x), *shape) if shape else x, "y": np.concatenate(ys)}

    out = Path(path)
    fields = [("x", np.dtype("<f4"), tuple(shape) if shape else (features,)), ("y", np.dtype("<i8"), ())]
    meta = {"source": "synthetic", "classes": classes, "features": features, "seed": seed}
    write_dataset_chunks(out, fields, records, chunks(), meta)
    return out

