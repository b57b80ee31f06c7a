"""Entry point of one rank process: `python -m kvstage.hw.rank.main ...` (also `kvstage hw-rank`).

Started again (same role and rank, the run's scenario, secret and rendezvous) while its
run goes on, a prefill rank rejoins it as a new incarnation (hw/rank/process.py); the launcher
must allow it (`kvstage hw --rejoin-grace S`) once it has noticed the rank gone."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstage.hw.rank.main",
        description="Run one prefill or decode rank of a kvstage hardware-mode run. Start one per "
        "rank (srun, torchrun or mpirun can place them on different nodes); they find each other "
        "through the rendezvous that `kvstage hw` (or `kvstage hw --no-spawn`) runs.",
    )
    p.add_argument("scenario", help="scenario TOML (use the run directory's scenario.toml)")
    p.add_argument(
        "--role",
        default=None,
        choices=["prefill", "decode"],
        help="default: from SLURM (SLURM_PROCID, SLURM_NTASKS) or torchrun (RANK, WORLD_SIZE): "
        "global ranks 0..P-1 are prefill 0..P-1, P..P+D-1 decode 0..D-1",
    )
    p.add_argument(
        "--rank", default=None, type=int, help="this rank's index in its role (with --role)"
    )
    p.add_argument(
        "--rendezvous",
        default=None,
        help="HOST:PORT of the rendezvous (default MASTER_ADDR:MASTER_PORT)",
    )
    p.add_argument(
        "--set", dest="sets", action="append", default=[], help="scenario override key=value"
    )
    p.add_argument("--backend", choices=["nixl", "mooncake"], default=None)
    p.add_argument(
        "--device",
        default=None,
        help="cpu, cuda or cuda:N (cuda: this rank's GPU, cuda:LOCAL_RANK, or cuda:0 where CUDA_VISIBLE_DEVICES binds one GPU to the task)",
    )
    p.add_argument(
        "--host",
        default=None,
        help="routable address this rank binds and advertises, and tells NIXL/UCX and Mooncake "
        "(default $KVSTAGE_HOST, else this host's address towards MASTER_ADDR, else 127.0.0.1)",
    )
    p.add_argument(
        "--secret-file",
        default=None,
        help="the run's secret: RUN_DIR/run.secret, written by `kvstage hw` (default: "
        "$KVSTAGE_RUN_SECRET, hex); a rank without one does not start",
    )
    p.add_argument(
        "--key-file",
        default=None,
        help="this rank's credential (RUN_DIR/keys/ROLERANK.key, written by `kvstage hw "
        "--no-spawn`; default: the descriptor $KVSTAGE_RANK_KEY_FD a launcher hands it, else "
        "the key file of this rank next to --secret-file); without one the rank cannot register",
    )
    p.add_argument(
        "--rendezvous-timeout",
        default=60.0,
        type=float,
        metavar="S",
        help="give up (exit 2) when the rendezvous has not answered within S seconds "
        "(default 60; the rank says it is waiting after 5 s)",
    )
    p.add_argument(
        "--register-at",
        default=None,
        type=float,
        metavar="EPOCH_S",
        help="start up, then register with the rendezvous no earlier than this wall-clock time "
        "(epoch seconds): the launcher starts a rank its fault killed again this way "
        "(faults.kill restart_after_s)",
    )
    return p


def main(argv: list[str] | None = None, *, clock_skew_s: float = 0.0) -> int:
    """`clock_skew_s`: an artificial error of this rank's clock (test wrappers only)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.rendezvous_timeout > 0:
        parser.error(
            f"--rendezvous-timeout must be more than 0 seconds, not {args.rendezvous_timeout}"
        )
    from kvstage.hw.control.credentials import CredentialError, read_credential
    from kvstage.hw.control.plane import SECRET_ENV, RunSecretError, read_secret_file, run_secret
    from kvstage.hw.launch.launcher import watch_launcher
    from kvstage.hw.transport.affinity import choose_for_rank
    from kvstage.hw.transport.placement import (
        PlacementError,
        default_host,
        engine_env,
        identity,
        quiet_engines,
        rank_device,
        rendezvous_address,
    )
    from kvstage.hw.transport.used import ucx_log_env
    from kvstage.shared.scenario import ScenarioError, load_scenario
    from kvstage.shared.serving.capacity import scenario_gpus

    watch_launcher()  # first: a launcher that dies from here on takes this rank along
    who = (
        f"{args.role}{args.rank}" if args.role is not None and args.rank is not None else "hw-rank"
    )
    try:
        secret = read_secret_file(args.secret_file) if args.secret_file else run_secret()
    except RunSecretError as exc:
        print(f"{who}: error: {exc}", file=sys.stderr)
        return 2
    try:
        scenario = load_scenario(args.scenario, overrides=args.sets)
        me = identity(
            args.role,
            args.rank,
            *scenario_gpus(scenario),  # ranks of every instance: instance * TP + local rank
        )
        rendezvous = rendezvous_address(args.rendezvous)
        device = rank_device(args.device or scenario.hardware.device, me.local_rank)
        credential = read_credential(f"{me.role}{me.rank}", args.key_file, args.secret_file)
    except (ScenarioError, PlacementError, ValueError, CredentialError) as exc:
        print(f"{who}: error: {exc}", file=sys.stderr)
        return 2
    args.role, args.rank = me.role, me.rank
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s {args.role}{args.rank} %(levelname)s %(message)s",
    )
    host = args.host or default_host()
    os.environ[SECRET_ENV] = secret.hex()  # this rank's control plane and rendezvous client read it
    quiet_engines(os.environ)
    aff = choose_for_rank(f"{args.role}{args.rank}", host, device, me.local_rank)
    if aff is None:  # a bad --nic-map / $KVSTAGE_NIC_MAP: said in one line
        return 2
    os.environ.update(engine_env(host, device, affinity=aff))
    ucx_log = None
    if (args.backend or scenario.hardware.backend) == "nixl":  # before NIXL loads UCX
        ucx_log = (
            Path(tempfile.gettempdir()) / f"kvstage-ucx-{args.role}{args.rank}-{os.getpid()}.log"
        )
        os.environ.update(ucx_log_env(ucx_log))
    if me.source != "flags":
        print(
            f"{args.role}{args.rank}: global rank {me.global_rank} from {me.source}, device {device}, "
            f"host {host}, rendezvous {rendezvous}",
            file=sys.stderr,
            flush=True,
        )
    import torch

    # Many ranks share this machine's cores: one intra-op thread each avoids
    # oversubscription that would stall every rank's event loop.
    torch.set_num_threads(int(os.environ.get("KVSTAGE_TORCH_THREADS", "1")))
    try:
        return _run_rank(args, scenario, rendezvous, device, host, clock_skew_s, credential)
    finally:
        if ucx_log is not None:
            ucx_log.unlink(missing_ok=True)  # read into the report; nothing left behind


def make_rank(scenario, role: str, rank: int, rendezvous: str, **kw):
    """The rank process of `role` (prefill or decode): the one place a role picks its class."""
    from kvstage.hw.rank.decode import DecodeRank
    from kvstage.hw.rank.prefill import PrefillRank
    from kvstage.hw.rank.process import RankError

    classes = {"prefill": PrefillRank, "decode": DecodeRank}
    if role not in classes:
        raise RankError(f"role {role!r} not allowed (allowed: prefill, decode)")
    return classes[role](scenario, rank, rendezvous, **kw)


def _run_rank(
    args: argparse.Namespace,
    scenario,
    rendezvous: str,
    device: str,
    host: str,
    clock_skew_s: float,
    credential: bytes,
) -> int:
    """Make the rank, run it, and say how it ended: 0 done, 1 failed, 2 could not start
    (one line: a bad scenario, an engine that cannot give what was asked), 3 launcher gone."""
    from kvstage.hw.control.rendezvous import RendezvousError
    from kvstage.hw.launch.launcher import LauncherGone
    from kvstage.hw.rank.process import RankError
    from kvstage.hw.transport.base import TransferError
    from kvstage.shared.scenario import ScenarioError

    try:
        rank = make_rank(
            scenario,
            args.role,
            args.rank,
            rendezvous,
            backend=args.backend,
            device=device,
            host=host,
            clock_skew_s=clock_skew_s,
            credential=credential,
        )
    except (ScenarioError, RankError, TransferError, ValueError) as exc:
        print(f"{args.role}{args.rank}: error: {exc}", file=sys.stderr)
        return 2
    try:
        report = rank.run(
            rendezvous_timeout_s=args.rendezvous_timeout, register_at=args.register_at
        )
    except LauncherGone as exc:
        print(f"{args.role}{args.rank}: {exc}: stopped", file=sys.stderr)
        rank.close()
        return 3
    except RendezvousError as exc:  # none there, a refusal, another run's secret: one line
        print(f"{args.role}{args.rank}: error: {exc}", file=sys.stderr)
        rank.close()
        return 2
    if report["error"]:
        print(report["error"], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
