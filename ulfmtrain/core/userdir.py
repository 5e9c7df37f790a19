"""This user's private folder on this host, and the host's own record of a rank's stop line.

The folder ($TMPDIR or /tmp)/ulfmtrain-UID, mode 0700, holds what no other user may reach: the fork servers'
sockets (membership/forkserver.py) and host.log.  A folder of that name that another user owns, that others
may enter, or that is a link is refused with one line: someone could be waiting in it.

Standard library only: the tether, which runs by path without the package, loads it from its file.
"""
from __future__ import annotations

import os
import stat
import tempfile
import time
from pathlib import Path

LOG_ENV = "ULFMTRAIN_HOST_LOG"        # where host_log writes (default: host.log in the private folder)


class UnsafeFolder(Exception):
    """The private folder's name is taken by something this user cannot trust."""


def private_dir() -> Path:
    """($TMPDIR or /tmp)/ulfmtrain-UID, made 0700 if missing; UnsafeFolder unless it is ours and closed to others."""
    d = Path(tempfile.gettempdir()) / f"ulfmtrain-{os.getuid()}"
    try:
        d.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = d.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        what = "a link" if stat.S_ISLNK(st.st_mode) else f"owned by uid {st.st_uid}, mode {stat.filemode(st.st_mode)}"
        raise UnsafeFolder(f"'{d}' is not a folder of this user's closed to others ({what}): ulfmtrain keeps "
                           "its sockets and host log only in one; remove it, or set TMPDIR to a folder of yours")
    return d


def host_log(line: str) -> None:
    """Keep `line` on this host: appended, with the time, to $ULFMTRAIN_HOST_LOG (default: host.log in the private
    folder), and sent to syslog where the host has one.  Best effort: the line went to stderr first, and a host
    cut off from the head has no other way to tell."""
    try:
        path = os.environ.get(LOG_ENV) or private_dir() / "host.log"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {line}\n".encode())
        finally:
            os.close(fd)
    except (OSError, UnsafeFolder):
        pass
    try:
        import syslog

        syslog.openlog("ulfmtrain", syslog.LOG_PID, syslog.LOG_USER)
        syslog.syslog(syslog.LOG_WARNING, line)
    except (ImportError, OSError):
        pass
