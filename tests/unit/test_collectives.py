"""What the fault path takes for a failed exchange (collectives.EXCHANGE_FAILED)."""
from __future__ import annotations

import pickle

import pytest

from ulfmtrain.transport.collectives import EXCHANGE_FAILED


@pytest.mark.parametrize("torn", [b"\x00" * 64,                                  # a peer's part never written
                                  pickle.dumps((1, 2, 0, 1, 1))[:-4],            # cut short
                                  b""])
def test_bytes_that_do_not_unpickle_are_a_failed_exchange(torn):
    """A 1000-failure soak: the repair's allgather returned success on two processes, with bytes that did not
    unpickle ("invalid load key, '\\x00'"); each process failed as if from a bug, instead of repairing again."""
    with pytest.raises(EXCHANGE_FAILED):
        pickle.loads(torn)


def test_a_bug_is_not_a_failed_exchange():
    assert not issubclass(ValueError, EXCHANGE_FAILED) and not issubclass(KeyError, EXCHANGE_FAILED)
