"""Run by the fork server's tests: say who and where it is, then `exit CODE` or `sleep` (until killed)."""
import json
import os
import sys
import time

print(json.dumps({"pid": os.getpid(), "cwd": os.getcwd(), "args": sys.argv[1:],
                  "forked": os.environ.get("ULFMTRAIN_FORKED"), "mine": os.environ.get("FORKED_CHILD_TEST"),
                  "torch": "torch" in sys.modules}), flush=True)
if sys.argv[1] == "sleep":
    time.sleep(120)
sys.exit(int(sys.argv[2]))
