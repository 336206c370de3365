"""Names of HostStore segments in /dev/shm, and the reclaim of those whose owner is gone.

A segment is named `vlax-kv-<pid>-<start>-<random>`: the creating process's id and its start time
(clock ticks since boot, /proc/<pid>/stat field 22), so a later process can tell that the owner
died even when its pid was reused since. A HostStore unlinks its file as soon as it is mapped; only
a process killed between creating and mapping it (e.g. SIGKILL during the reservation of a large
region) leaves one, and the next HostStore in any process reclaims it.
"""

import logging
import os
import re
import secrets

__all__ = ["SEGMENT_PREFIX", "new_segment_path", "reclaim_stale_segments", "segment_name"]

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "vlax-kv-"
# The start field is absent in names made before it was added: those are judged by pid alone.
_NAME = re.compile(rf"^{SEGMENT_PREFIX}(\d+)-(?:(\d+)-)?[0-9a-f]{{16}}$")


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; None if it does not exist (or this
    system has no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count fields after its end.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[19])


def segment_name(pid: int, start: int | None) -> str:
    return f"{SEGMENT_PREFIX}{pid}-{start or 0}-{secrets.token_hex(8)}"


def new_segment_path(shm_dir: str) -> str:
    pid = os.getpid()
    return os.path.join(shm_dir, segment_name(pid, process_start(pid)))


def owner_alive(pid: int, start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    if not start:
        return True
    now = process_start(pid)
    # No /proc entry for a pid that answers signals: trust the pid alone.
    return now is None or now == start


def reclaim_stale_segments(shm_dir: str) -> list[str]:
    """Unlink every vlax segment in `shm_dir` whose owner process is gone; returns their paths."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    reclaimed = []
    for name in names:
        match = _NAME.match(name)
        if match is None:
            continue
        pid, start = int(match[1]), int(match[2]) if match[2] else None
        if owner_alive(pid, start):
            continue
        path = os.path.join(shm_dir, name)
        try:
            nbytes = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            continue  # another process reclaimed it first
        except OSError as err:
            log.warning("cannot reclaim %s, left by process %d, which is gone: %s", path, pid, err)
            continue
        log.warning(
            "reclaimed %s (%d bytes), a host KV store segment left by process %d, which is gone",
            path,
            nbytes,
            pid,
        )
        reclaimed.append(path)
    return reclaimed
