"""Where a rank runs and who it is: addresses, network devices, identity from SLURM/torchrun.

Placement. Every rank binds its control socket on one routable address and advertises
that same address; the transfer engines are told the same: Mooncake's local server name
and MC_TCP_BIND_ADDRESS, and UCX (under NIXL) UCX_NET_DEVICES = the interface that holds
the address (`lo` on loopback) on a host without RDMA devices, or the rank's rail NIC
(hw/transport/affinity.py: `mlx5_N:1` for RDMA; Mooncake gets its device name). A variable the
user set is never overridden.

Identity. `kvstage hw-rank` without --role/--rank takes them from the launcher of the
job: SLURM (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) or torchrun (RANK, WORLD_SIZE,
LOCAL_RANK). Global ranks 0..P-1 are prefill ranks 0..P-1, global ranks P..P+D-1 are
decode ranks 0..D-1; the world size must be P+D. The rendezvous is --rendezvous, else
MASTER_ADDR:MASTER_PORT. Device "cuda" means cuda:LOCAL_RANK.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from kvstage.hw.transport.affinity import RANK_NIC_ENV, Affinity, interface_of, is_loopback
from kvstage.hw.transport.used import rdma_devices

LOOPBACK = "127.0.0.1"


class PlacementError(ValueError):
    """The environment does not say who this rank is, or says it inconsistently."""


def route_source(peer: str, port: int = 9) -> str | None:
    """The local address this host would use to reach `peer` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, port))
            return s.getsockname()[0]
    except OSError:
        return None


def default_host(env: Mapping[str, str] | None = None) -> str:
    """The address a rank binds and advertises when not told: $KVSTAGE_HOST; else, when
    MASTER_ADDR names another host, this host's address on the route to it; else loopback."""
    env = os.environ if env is None else env
    if env.get("KVSTAGE_HOST"):
        return env["KVSTAGE_HOST"]
    master = env.get("MASTER_ADDR", "")
    if master and not is_loopback(master):
        try:
            src = route_source(socket.gethostbyname(master))
        except OSError:
            src = None
        if src:
            return src
    return LOOPBACK


def advertised(bind: str) -> str:
    """The address peers should connect to for a socket bound on `bind`."""
    if bind not in ("0.0.0.0", "*", ""):
        return bind
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return LOOPBACK


def launch_addresses(
    host: str | None, bind: str | None, advertise: str | None, env: Mapping[str, str] | None = None
) -> tuple[str, str, str]:
    """(bind, advertise, host) of a launcher: the rendezvous binds `bind` (default `host`,
    $KVSTAGE_HOST, else loopback; 0.0.0.0: every address) and ranks connect to `advertise`
    (default `bind`, or this host name's address for a wildcard); spawned ranks bind and
    advertise `host` (default the rendezvous' advertised address)."""
    env = os.environ if env is None else env
    bind = bind or host or env.get("KVSTAGE_HOST") or LOOPBACK
    advertise = advertise or advertised(bind)
    return bind, advertise, host or advertise


# The engines' log levels wherever they run (ranks, the probes): warnings and errors only.
ENGINE_LOG_LEVELS = {"NIXL_LOG_LEVEL": "WARN", "MC_LOG_LEVEL": "ERROR"}


def quiet_engines(env: MutableMapping[str, str]) -> None:
    """Set ENGINE_LOG_LEVELS in `env` (os.environ, or a child's environment) where unset."""
    for key, value in ENGINE_LOG_LEVELS.items():
        env.setdefault(key, value)


def engine_env(
    host: str,
    device: str | None = None,
    env: Mapping[str, str] | None = None,
    rdma: list[str] | None = None,
    affinity: Affinity | None = None,
) -> dict[str, str]:
    """Variables that keep the transfer engines on `host` (only those not already set).

    With this rank's `affinity` (hw/transport/affinity.py): UCX_NET_DEVICES is its NIC
    (`mlx5_N:PORT` for an RDMA NIC) and Mooncake's device name is that NIC
    (RANK_NIC_ENV, read by transport_options). Without one, UCX_NET_DEVICES names the IP
    interface of `host` only on a host without RDMA devices (`rdma`: default this
    host's, from sysfs): UCX names RDMA devices `mlx5_N:1`, so an IP interface there
    would rule RDMA out without a word. A user's UCX_NET_DEVICES stands."""
    env = os.environ if env is None else env
    out = {"MC_TCP_BIND_ADDRESS": host}
    if is_loopback(host):
        if not str(device or "").startswith("cuda"):
            out["UCX_NET_DEVICES"] = "lo"  # ranks on loopback need no other network device
    elif affinity is not None and affinity.ucx_device:
        out["UCX_NET_DEVICES"] = affinity.ucx_device
        if affinity.kind == "rdma":
            out[RANK_NIC_ENV] = affinity.nic
    elif not (rdma_devices() if rdma is None else rdma):
        iface = interface_of(host)
        if iface:
            out["UCX_NET_DEVICES"] = iface
    return {k: v for k, v in out.items() if not env.get(k)}


def transport_options(hardware: Any, backend: str, host: str) -> dict[str, Any]:
    """The adapter's options for `backend` from the scenario's [hardware] table."""
    if backend == "mooncake":
        return {
            "protocol": hardware.mooncake_protocol,
            # the scenario's device stands; else this rank's rail NIC (hw/transport/affinity.py)
            "device_name": hardware.mooncake_device
            or (os.environ.get(RANK_NIC_ENV, "") if hardware.mooncake_protocol == "rdma" else ""),
            "host": host,
        }
    return {}


@dataclass(frozen=True)
class Identity:
    role: str
    rank: int  # within the role
    global_rank: int | None = None
    local_rank: int | None = None
    source: str = "flags"  # flags, slurm or torchrun


def role_of(global_rank: int, prefill_tp: int, decode_tp: int) -> tuple[str, int]:
    """Global rank -> (role, rank): 0..P-1 prefill, P..P+D-1 decode."""
    if not 0 <= global_rank < prefill_tp + decode_tp:
        raise PlacementError(
            f"global rank {global_rank} outside 0..{prefill_tp + decode_tp - 1} "
            f"(prefill TP{prefill_tp} + decode TP{decode_tp})"
        )
    if global_rank < prefill_tp:
        return "prefill", global_rank
    return "decode", global_rank - prefill_tp


def _int(env: Mapping[str, str], key: str) -> int:
    text = env.get(key, "")
    try:
        value = int(text)
    except ValueError:
        raise PlacementError(f"${key} = {text!r} is not an integer") from None
    if value < 0:
        raise PlacementError(f"${key} = {value} is negative")
    return value


def identity(
    role: str | None,
    rank: int | None,
    prefill_tp: int,
    decode_tp: int,
    env: Mapping[str, str] | None = None,
) -> Identity:
    """This rank's identity: from --role/--rank when given, else from SLURM or torchrun."""
    env = os.environ if env is None else env
    local = (
        _int(env, "LOCAL_RANK")
        if "LOCAL_RANK" in env
        else (_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else None)
    )
    if role is not None or rank is not None:
        if role is None or rank is None:
            raise PlacementError(
                "give both --role and --rank, or neither (then SLURM or torchrun say)"
            )
        return Identity(role, rank, None, local, "flags")
    if "RANK" in env and "WORLD_SIZE" in env:
        source, rank_key, world_key = "torchrun", "RANK", "WORLD_SIZE"
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        source, rank_key, world_key = "slurm", "SLURM_PROCID", "SLURM_NTASKS"
    else:
        raise PlacementError(
            "no --role/--rank and neither torchrun (RANK, WORLD_SIZE) nor SLURM "
            "(SLURM_PROCID, SLURM_NTASKS) says who this rank is"
        )
    world = _int(env, world_key)
    if world != prefill_tp + decode_tp:
        raise PlacementError(
            f"${world_key} = {world} but the scenario has prefill TP{prefill_tp} + decode "
            f"TP{decode_tp} = {prefill_tp + decode_tp} ranks: start exactly that many"
        )
    global_rank = _int(env, rank_key)
    role, rank = role_of(global_rank, prefill_tp, decode_tp)
    return Identity(role, rank, global_rank, local, source)


def rendezvous_address(flag: str | None, env: Mapping[str, str] | None = None) -> str:
    """--rendezvous, else MASTER_ADDR:MASTER_PORT."""
    env = os.environ if env is None else env
    if flag:
        return flag
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"{env['MASTER_ADDR']}:{_int(env, 'MASTER_PORT')}"
    raise PlacementError(
        "no rendezvous: give --rendezvous HOST:PORT or set MASTER_ADDR and MASTER_PORT"
    )


def visible_gpus(env: Mapping[str, str] | None = None) -> int | None:
    """How many GPUs CUDA_VISIBLE_DEVICES lets this process see; None when it is unset
    (every GPU of the node is visible)."""
    env = os.environ if env is None else env
    text = env.get("CUDA_VISIBLE_DEVICES")
    if text is None:
        return None
    # CUDA stops at the first invalid entry ("-1" hides every GPU): count what precedes it
    count = 0
    for entry in (e.strip() for e in text.split(",")):
        if not entry or entry.startswith("-"):
            break
        count += 1
    return count


def rank_device(device: str, local_rank: int | None, env: Mapping[str, str] | None = None) -> str:
    """Plain "cuda" on a rank with a local rank is that rank's GPU; anything else as given.

    Which ordinal that is depends on what the process sees. With every GPU visible
    (torchrun, or SLURM without GPU binding) it is cuda:LOCAL_RANK. Where the scheduler
    binds GPUs to tasks (SLURM --gpus-per-task=1 or --gpu-bind, containers) the task's
    CUDA_VISIBLE_DEVICES lists only its own: one GPU is cuda:0, and with several the
    local rank counts among those (an error when it is past the last of them)."""
    if device != "cuda" or local_rank is None:
        return device
    visible = visible_gpus(env)
    if visible is None or visible > local_rank:
        return f"cuda:{local_rank}"
    if visible == 1:
        return "cuda:0"
    if visible == 0:
        raise PlacementError(
            f"device cuda, but CUDA_VISIBLE_DEVICES = "
            f"{(os.environ if env is None else env)['CUDA_VISIBLE_DEVICES']!r} hides every GPU"
        )
    raise PlacementError(
        f"local rank {local_rank} but CUDA_VISIBLE_DEVICES lists {visible} GPUs: bind one GPU "
        f"per task, or let each task see all of its node's GPUs"
    )
