"""Run by the fork server's tests: say who and where it is, then `exit CODE` or `sleep` (until killed)."""
import json
import os
import signal
import sys
import time

print(json.dumps({"pid": os.getpid(), "cwd": os.getcwd(), "args": sys.argv[1:],
                  "forked": os.environ.get("ULFMTRAIN_FORKED"), "mine": os.environ.get("FORKED_CHILD_TEST"),
                  "torch": "torch" in sys.modules, "sid": os.getsid(0), "pgid": os.getpgid(0),
                  "signals": {s.name: getattr(signal.getsignal(s), "name", None) or signal.getsignal(s).__name__
                              for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1,
                                        signal.SIGPIPE)}}), flush=True)
if sys.argv[1] == "sleep":
    time.sleep(120)
sys.exit(int(sys.argv[2]))
