"""Datasets on disk, who holds which records, and the exactly-once sampler over them.

- :mod:`.format`: the ``.ulfmds`` file layout and :class:`DatasetFile`, which reads one.
- :mod:`.writer`: writing ``.ulfmds`` files atomically.
- :mod:`.sources`: converters (scikit-learn digits, arrays, synthetic).
- :mod:`.plan`: pure range planning: initial shards, recovery plans, coverage checks.
- :mod:`.shard`: :class:`LocalShard`, the records one rank holds in memory.
- :mod:`.sampler`: exactly-once epoch queues.
- :mod:`.loader`: :class:`ExactlyOnceSampler`, those queues as a batch sampler for torch's DataLoader.

Nothing here imports torch or MPI: the data tools stay light.

Layer 3, training (beside ulfmtrain.training).  The rule: a module here imports only from this layer and the
ones below (transport, core); the layers, lowest first, are ulfmtrain._LAYERS.
"""

from __future__ import annotations

from .format import (
    FORMAT_VERSION,
    MAGIC,
    RECORD_ALIGN,
    SUFFIX,
    DatasetError,
    DatasetFile,
    dataset_paths,
    split_path,
)
from .loader import ExactlyOnceSampler
from .plan import (
    Ranges,
    RecoveryPlan,
    check_coverage,
    initial_holdings,
    merge_ranges,
    plan_recovery,
    ranges_len,
    split_ranges,
)
from .sampler import EpochSampler, distributed_sampler
from .shard import LocalShard
from .sources import arrays_to_dataset, digits_to_dataset, records_for_bytes, synthetic_dataset
from .writer import write_dataset, write_dataset_chunks

__all__ = [
    "MAGIC",
    "RECORD_ALIGN",
    "FORMAT_VERSION",
    "SUFFIX",
    "Ranges",
    "DatasetError",
    "DatasetFile",
    "split_path",
    "dataset_paths",
    "write_dataset",
    "write_dataset_chunks",
    "digits_to_dataset",
    "arrays_to_dataset",
    "synthetic_dataset",
    "records_for_bytes",
    "initial_holdings",
    "merge_ranges",
    "ranges_len",
    "split_ranges",
    "RecoveryPlan",
    "plan_recovery",
    "check_coverage",
    "LocalShard",
    "EpochSampler",
    "distributed_sampler",
    "ExactlyOnceSampler",
]
