"""The fork server with a selector that hands out, in one batch, every event ready within 0.3 s, a reaped
child's first: the order in which the deaths of a shim and its child at once (a host's processes killed
together) can reach the server.  `python -m batching_forkserver ADDRESS WATCHED_PID`."""
import selectors
import sys
import time

from ulfmtrain.membership import forkserver


class BatchingSelector(selectors.DefaultSelector):
    def select(self, timeout=None):
        super().select(timeout)
        time.sleep(0.3)
        ready = super().select(0)      # level-triggered: what was ready is still ready, with what came since
        return sorted(ready, key=lambda event: event[0].data != "reap")


forkserver.selectors.DefaultSelector = BatchingSelector
forkserver.serve(sys.argv[1], int(sys.argv[2]))
