"""Entry point of one rank process: `python -m kvstage.hw.rank_main ...` (also `kvstage hw-rank`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstage.hw.rank_main",
        description="Run one prefill or decode rank of a kvstage hardware-mode run. Start one per "
        "rank (srun, torchrun or mpirun can place them on different nodes); they find each other "
        "through the rendezvous that `kvstage hw` (or `kvstage hw --no-spawn`) runs.",
    )
    p.add_argument("scenario", help="scenario TOML (use the run directory's scenario.toml)")
    p.add_argument("--role", required=True, choices=["prefill", "decode"])
    p.add_argument("--rank", required=True, type=int)
    p.add_argument("--rendezvous", required=True, help="HOST:PORT of the rendezvous")
    p.add_argument("--set", dest="sets", action="append", default=[], help="scenario override key=value")
    p.add_argument("--backend", choices=["nixl", "mooncake"], default=None)
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N")
    p.add_argument("--host", default=os.environ.get("KVSTAGE_HOST", "127.0.0.1"),
                   help="address this rank's control socket binds (default 127.0.0.1)")
    p.add_argument("--secret-file", default=None,
                   help="the run's secret: RUN_DIR/run.secret, written by `kvstage hw` (default: "
                        "$KVSTAGE_RUN_SECRET, hex); a rank without one does not start")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {args.role}{args.rank} %(levelname)s %(message)s")
    from kvstage.hw.control import SECRET_ENV, RunSecretError, read_secret_file, run_secret
    from kvstage.hw.launch import LauncherGone, watch_launcher

    watch_launcher()  # first: a launcher that dies from here on takes this rank along
    try:
        secret = read_secret_file(args.secret_file) if args.secret_file else run_secret()
    except RunSecretError as exc:
        print(f"{args.role}{args.rank}: error: {exc}", file=sys.stderr)
        return 2
    os.environ[SECRET_ENV] = secret.hex()  # this rank's control plane and rendezvous client read it
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", args.host)
    import torch

    # Many ranks share this machine's cores: one intra-op thread each avoids
    # oversubscription that would stall every rank's event loop.
    torch.set_num_threads(int(os.environ.get("KVSTAGE_TORCH_THREADS", "1")))
    from kvstage.hw.rank import RankError, make_rank
    from kvstage.shared.scenario import ScenarioError, load_scenario

    try:
        scenario = load_scenario(args.scenario, overrides=args.sets)
        rank = make_rank(scenario, args.role, args.rank, args.rendezvous, backend=args.backend,
                         device=args.device, host=args.host)
    except (ScenarioError, RankError, ValueError) as exc:
        print(f"{args.role}{args.rank}: error: {exc}", file=sys.stderr)
        return 2
    try:
        report = rank.run()
    except LauncherGone as exc:
        print(f"{args.role}{args.rank}: {exc}: stopped", file=sys.stderr)
        rank.close()
        return 3
    if report["error"]:
        print(report["error"], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
