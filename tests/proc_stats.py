"""What /proc says about processes: their CPU time, the processes of a group, and the TCP
connections they hold. Used by the tests and benchmarks that measure an agent from outside
(tests/agent_harness.py, tests/forwarder/test_kafka_idle_connections.py, bench/)."""

from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
TCP_ESTABLISHED = "01"


def stat(path: Path) -> tuple[str, int, float] | None:
    """(comm, process group, user + system CPU seconds) of a /proc ``stat`` file (a process's
    or a thread's), or None when it is gone."""
    try:
        text = path.read_text()
        comm = text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        return comm, int(fields[2]), (int(fields[11]) + int(fields[12])) / TICK
    except (OSError, ValueError, IndexError):
        return None  # exited meanwhile


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (every thread of it); 0 when it is gone."""
    got = stat(Path(f"/proc/{pid}/stat"))
    return got[2] if got is not None else 0.0


def group_pids(leader: int) -> list[int]:
    """Every process of the process group ``leader`` leads (an agent's ingest and forwarder:
    it runs in a session of its own)."""
    pids = []
    for path in Path("/proc").glob("[0-9]*/stat"):
        got = stat(path)
        if got is not None and got[1] == leader:
            pids.append(int(path.parent.name))
    return sorted(pids)


def socket_inodes(pids: list[int]) -> set[int]:
    """The inodes of the sockets the processes hold open."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                inodes.add(int(target[len("socket:["):-1]))
    return inodes


def established(pids: list[int], ports: set[int]) -> list[tuple[int, int]]:
    """(local port, remote port) of each ESTABLISHED TCP connection of the processes to one
    of ``ports``: ``/proc/<pid>/fd`` names each socket's inode, ``/proc/net/tcp`` its
    addresses and state."""
    inodes = socket_inodes(pids)
    found = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pids[0] if pids else 'self'}/net/{table}").read_text()
        except OSError:
            continue
        for line in lines.splitlines()[1:]:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], int(fields[9])
            if state != TCP_ESTABLISHED or inode not in inodes:
                continue
            remote_port = int(remote.rsplit(":", 1)[1], 16)
            if remote_port in ports:
                found.append((int(local.rsplit(":", 1)[1], 16), remote_port))
    return sorted(found)
