"""The network endpoints of a process tree, for loopback checks in tests and benches.

A local run must listen on loopback only and talk to nothing else. ``tree_sockets(root)``
reads, from the kernel through psutil, every inet socket of ``root`` and its descendants
(AReaL's workers, the vLLM server and its engine core, the monitor, the gym, the agent), and
``off_loopback`` keeps those that listen on, or are connected to, an address outside
127.0.0.0/8 and ::1 (a wildcard ``0.0.0.0`` / ``::`` listener is outside: it answers on every
interface).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import psutil

CMD_CHARS = 160


@dataclass(frozen=True)
class Endpoint:
    """One inet socket of one process."""

    pid: int
    cmd: str  # the process's command line (shortened), to say whose socket it is
    status: str  # psutil.CONN_LISTEN, psutil.CONN_ESTABLISHED, ...
    local: str  # "ip:port"
    remote: str  # "ip:port", "" when unconnected

    def __str__(self) -> str:
        far = f" -> {self.remote}" if self.remote else ""
        return f"[{self.pid}] {self.status} {self.local}{far} ({self.cmd})"


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1 and the IPv4-mapped ::ffff:127.x (not the wildcards)."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def process_tree(root: int) -> list[psutil.Process]:
    """``root`` and every live descendant (processes that exit meanwhile are skipped)."""
    try:
        top = psutil.Process(root)
        return [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _addr(a) -> str:
    return f"{a.ip}:{a.port}" if a else ""


def tree_sockets(root: int) -> list[Endpoint]:
    """Every inet (TCP and UDP, IPv4 and IPv6) socket of ``root``'s process tree."""
    found = []
    for proc in process_tree(root):
        try:
            conns = proc.net_connections(kind="inet")
            cmd = " ".join(proc.cmdline())[:CMD_CHARS]
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        for c in conns:
            found.append(Endpoint(proc.pid, cmd, c.status, _addr(c.laddr), _addr(c.raddr)))
    return found


def _listens(e: Endpoint) -> bool:
    # An unconnected UDP socket (status NONE, no remote) receives from anyone: a listener too.
    return e.status == psutil.CONN_LISTEN or (e.status == psutil.CONN_NONE and not e.remote)


def _ip(hostport: str) -> str:
    return hostport.rsplit(":", 1)[0]


def listening(endpoints: list[Endpoint]) -> list[Endpoint]:
    """The TCP listeners and unconnected UDP sockets."""
    return [e for e in endpoints if _listens(e)]


def off_loopback(endpoints: list[Endpoint]) -> list[Endpoint]:
    """Those listening on, or connected to, an address outside loopback."""
    return [
        e
        for e in endpoints
        if (not is_loopback(_ip(e.local)) if _listens(e) else not is_loopback(_ip(e.remote)))
    ]
