"""Where a measuring process of `kvstage calibrate` runs: its address, and a network
namespace to enter first (two namespaces joined by a veth are two hosts on one machine).

`kvstage calibrate --host A --peer-host B --peer-netns NS`: the sending process stays
where the command runs and binds A; the receiving process enters NS (Linux setns on
/var/run/netns/NS, before any engine or thread starts, so everything it starts is in
NS) and binds B. Both tell their engines their address (MC_TCP_BIND_ADDRESS, and
UCX_NET_DEVICES = the interface holding it, as hw/transport/placement.py engine_env does for a
rank) and ask UCX to log its protocol choices, so the sender can say what carried its
writes (hw/transport/used.py): only writes that left the host make an inter-host
figure. For NIXL between namespaces set UCX_TLS=tcp: UCX sees one machine and would
otherwise copy with CMA, which crosses no network.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLONE_NEWNET = 0x40000000  # [C] linux/sched.h
NETNS_DIR = Path("/var/run/netns")  # where `ip netns add` keeps its namespaces [C] iproute2


class ProbeHostError(ValueError):
    """A namespace or address that cannot be used; the message is one line."""


@dataclass(frozen=True)
class ProbeHost:
    address: str
    netns: str | None = None

    def describe(self) -> str:
        return f"{self.address}" + (f" (netns {self.netns})" if self.netns else "")

    def check(self) -> None:
        """Refuse (ProbeHostError) a namespace that does not exist, before any process starts."""
        if self.netns is not None and not (NETNS_DIR / self.netns).exists():
            raise ProbeHostError(
                f"--peer-netns {self.netns!r}: no such network namespace ({NETNS_DIR / self.netns} "
                f"is absent); allowed: one of `ip netns list`"
            )

    def enter(self, role: str) -> None:
        """In the measuring process, first thing: its namespace, then its engines' address."""
        from kvstage.hw.transport.placement import engine_env
        from kvstage.hw.transport.used import ucx_log_env

        if self.netns is not None:
            _enter_netns(self.netns)
        os.environ.update(engine_env(self.address, "cpu", rdma=[]))
        log = Path(tempfile.gettempdir()) / f"kvstage-cal-ucx-{role}-{os.getpid()}.log"
        os.environ.update(ucx_log_env(log))

    def transport_options(self, backend: str) -> dict[str, Any]:
        return {"host": self.address} if backend == "mooncake" else {}


CLONE_NEWNS = 0x00020000  # [C] linux/sched.h
MS_REC, MS_SLAVE, MNT_DETACH = 0x4000, 0x80000, 2  # [C] linux/mount.h


def _enter_netns(name: str) -> None:
    """As `ip netns exec` does [C: iproute2 lib/namespace.c]: join the namespace, then, in a
    mount namespace of this process's own, mount a sysfs of it on /sys, so that what
    reads /sys/class/net (UCX's device list, kvstage's counters) sees its devices."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise ProbeHostError(f"{what} for netns {name}: {os.strerror(ctypes.get_errno())}")

    fd = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        check(libc.setns(fd, CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(CLONE_NEWNS), "unshare(mount)")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", MNT_DETACH), "umount /sys")
    check(libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None), "mount sysfs")


def inter_host(sender: ProbeHost | None, receiver: ProbeHost | None) -> bool:
    """Whether the two processes were placed on two hosts (addresses or namespaces differ)."""
    if sender is None or receiver is None:
        return False
    return (sender.address, sender.netns) != (receiver.address, receiver.netns)
