"""Hardware profiles: the profile files `[links] profile = "..."` names, where they
are looked up, and the link numbers a scenario resolves to.

A profile gives the network's numbers in the units people quote them in
(PROFILE_FIELDS); [links] may override any of them. The GPUs are not here: they are
`prefill.gpu` / `decode.gpu` (gpus.py), except the copy numbers of a calibrated host. `_resolve_links` merges the two
and checks that the numbers the placement needs exist; `ResolvedLinks` holds the
result in SI units (bytes/s, seconds, FLOP/s), which is what both modes read.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, ValidationError

from kvstage.shared.scenario.errors import _explain, _FieldProblem
from kvstage.shared.scenario.fieldtypes import NonNegFloat, PosFloat, _Table

if TYPE_CHECKING:
    from kvstage.shared.scenario.schema import LinksConfig

__all__ = [
    "ENGINE_FIELDS",
    "HOST_FIELDS",
    "PROFILE_FIELDS",
    "REPO_PROFILES",
    "HostNumbers",
    "LinkNumbers",
    "ResolvedLinks",
    "available_profiles",
    "links_table",
    "profile_dirs",
]

# The repository's own profiles: the last place a profile name is looked up.
REPO_PROFILES = Path(__file__).resolve().parents[2] / "scenarios" / "profiles"

# The optional host model (sim/host.py), opt-in per profile: with host_model =
# "cpu-loop" every rank is ONE single-threaded loop (hw/rank/process.py) that serialises its
# event handling, pattern fills, gathers and scatters, and that loop work is slowed by
# the host's CPU sharing. Absent (or "gpu"): the default GPU model, unchanged.
#   host_model          "gpu" | "cpu-loop"
#   host_cores          CPU cores the P + D rank processes share (cpu-loop only)
#   engine_thread_cores cores each rank process's transfer engine keeps busy on its
#                       own (e.g. NIXL's UCX progress thread), >= 0
#   event_us            loop CPU time of handling one delivered event (message,
#                       completion) in a rank loop, before CPU sharing
#   fill_latency_us     hw-mode prefill 'forward' (pattern fill of one chunk):
#   fill_bandwidth_gbs    t = fill_latency + KV bytes of the chunk / fill_bandwidth (GB/s)
# optional (absent: 0), cpu-loop only:
#   background_cores    cores other processes on the host keep busy
#   loop_poll_us        a rank loop's poll period while its threads work: a finished
#                       fill, gather or scatter waits half of it on average
#   forward_nice        the forward thread's nice level above the loop's (CPU weight
#                       1.25 ** -nice)
#   loop_rt             true: the loop thread runs in a real-time class (hw/rank/process.py
#                       LoopPriority, the hardware default): it takes a core whenever
#                       it has work, ahead of every other thread (absent: false)
#   write_on_cpu        true: a write is a copy by a CPU thread of the writing rank (one
#                       lane per peer, as hw/transport/base.py's): host memory over loopback,
#                       where the engine copies the bytes itself; its time alone is the
#                       link's (latency, posting, bytes / bandwidth), stretched by the
#                       shared cores like any thread's work (absent: false, a link flow)
#   write_cpu_threads   threads a write keeps busy for its whole time with write_on_cpu
#                       (a socket transport copies on both ends: 2; absent: 1)
#   write_rt            true: those threads run in a real-time class below the loop's
#                       (hw/rank/priority.py WritePriority raises Mooncake's engine threads): a
#                       write takes its cores ahead of fills, gathers and scatters
#                       (absent: false)
#   copy_op_us          CPU a gather or scatter costs its rank beyond the kernel (the
#                       hand-off to the copy thread, the index glue, the completion that
#                       wakes the loop), the same for a small copy as for a big one; it
#                       is work like the kernel's, times copy_scale (absent: 0)
#   fill_cpu_scale      the CPU a fill, a copy (with copy_op_us) and a write on the
#   copy_cpu_scale        writer's lane (write_on_cpu) take among busy ranks, over their
#   write_cpu_scale       time alone, as hw ranks measure it (summary.json job_cpu). Set,
#                       a step's CPU is alone x this and the rest of its *_scale is time
#                       without a core (the interpreter lock, a lower nice level): it
#                       loads no other thread (absent: all of *_scale is CPU)
# optional (absent: 1), cpu-loop only: in-run factors `kvstage calibrate` fits from a
# short hardware run of its own scenario (kvstage/calibrate/inrun.py): how much longer a
# step takes among the other ranks than alone, beyond what the shared cores explain
#   fill_scale          the forward's fill work
#   copy_scale          gather and scatter work
#   control_scale       the control latency of a message
#   event_scale         a rank loop's time per event over its CPU (event_us): the rest
#                       holds the loop without using a core (waits for the interpreter
#                       lock, for a core, for the next poll)
#   write_scale         a bulk or slice write (latency, posting and bytes / bandwidth)
HOST_REQUIRED: tuple[str, ...] = (
    "host_model",
    "host_cores",
    "engine_thread_cores",
    "event_us",
    "fill_latency_us",
    "fill_bandwidth_gbs",
)
HOST_OPTIONAL: tuple[str, ...] = (
    "background_cores",
    "loop_poll_us",
    "forward_nice",
    "fill_scale",
    "copy_scale",
    "control_scale",
    "write_scale",
    "event_scale",
    "loop_rt",
    "write_on_cpu",
    "write_cpu_threads",
    "write_rt",
    "copy_op_us",
    "fill_cpu_scale",
    "copy_cpu_scale",
    "write_cpu_scale",
)
HOST_FIELDS: tuple[str, ...] = (*HOST_REQUIRED, *HOST_OPTIONAL)
HostModel = Literal["gpu", "cpu-loop"]

# The transfer engine's posting and the NIC's message rate (sim/links.py), per link
# class (<p> = inter | intra); all optional, absent = the cost is not modeled:
#   <p>_per_request_us       posting CPU of one work request (build + post + complete)
#                            with descriptors prepared once and reused
#   <p>_prep_per_request_us  descriptor preparation per request, paid on every batch
#                            unless descriptor_reuse = true
#   <p>_per_batch_us         posting CPU of one batch call (one transfer)
#   <p>_message_rate_mps     work requests per second one NIC side processes, millions
#                            (0: no limit)
#   post_threads             posting threads per rank: a rank's batches queue for them
#                            (0 or absent: every batch posts at once, in parallel)
#   descriptor_reuse         the engine reuses descriptor lists prepared at registration
#                            (NIXL prep_xfer_dlist + make_prepped_xfer); default false
ENGINE_FIELDS: tuple[str, ...] = (
    "inter_prep_per_request_us",
    "inter_per_batch_us",
    "inter_message_rate_mps",
    "intra_prep_per_request_us",
    "intra_per_batch_us",
    "intra_message_rate_mps",
    "post_threads",
    "descriptor_reuse",
)

# Profile fields in the units people quote them in (Gbit/s for links, GB/s for HBM,
# microseconds, TFLOP/s). `ResolvedLinks` holds the same numbers in SI units.
PROFILE_FIELDS: tuple[str, ...] = (
    "inter_bandwidth_gbps",
    "inter_latency_us",
    "inter_per_request_us",
    "intra_bandwidth_gbps",
    "intra_latency_us",
    "intra_per_request_us",
    *ENGINE_FIELDS,
    "control_latency_us",
    "gpus_per_nic",
    "mem_bandwidth_gbs",
    "kernel_launch_us",
    "gpu_tflops",
    *HOST_FIELDS,
)
# Needed in every profile. mem_bandwidth_gbs, kernel_launch_us and gpu_tflops are GPU
# numbers: the GPU catalogue (gpus.py) has them; a profile gives them only where a
# calibrated host stands in for the GPU (loopback-cpu, kvstage calibrate's files), and
# then its copy kernels (gather, scatter) take them instead of the catalogue GPU's.
_COMMON_FIELDS = (
    "control_latency_us",
    "gpus_per_nic",
)


def _placement_fields(placement: str) -> tuple[str, str, str]:
    return (f"{placement}_bandwidth_gbps", f"{placement}_latency_us", f"{placement}_per_request_us")


@dataclass(frozen=True, slots=True)
class LinkNumbers:
    """One link class and its transfer engine in SI units (see ENGINE_FIELDS): what the
    scenario resolves and what the simulator's fabric (sim/links.py) moves bytes by.

    bandwidth_bytes_s: per-flow path cap (``math.inf``: no cap); latency_s: one-way,
    once per transfer; message_rate: work requests/s one NIC side processes."""

    bandwidth_bytes_s: float
    latency_s: float
    per_request_s: float  # posting CPU of each work request, descriptor preparation included
    per_batch_s: float = 0.0  # posting CPU of each batch call
    message_rate: float = math.inf  # work requests/s of one NIC side; inf: no limit
    post_threads: int = 0  # posting threads per rank; 0: unlimited

    def __post_init__(self) -> None:
        # The scenario checks these with a message naming the field; this guards the
        # simulator's own callers (tests, benchmarks) that build one directly.
        if not self.bandwidth_bytes_s > 0:
            raise ValueError(f"bandwidth_bytes_s must be > 0, got {self.bandwidth_bytes_s}")
        for name in ("latency_s", "per_request_s", "per_batch_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be finite and >= 0, got {v}")
        if not self.message_rate > 0:
            raise ValueError(
                f"message_rate must be > 0 (math.inf: no limit), got {self.message_rate}"
            )
        if not (isinstance(self.post_threads, int) and self.post_threads >= 0):
            raise ValueError(f"post_threads must be an int >= 0, got {self.post_threads!r}")


@dataclass(frozen=True, slots=True)
class HostNumbers:
    """The cpu-loop host model's inputs in SI units (see HOST_FIELDS)."""

    cores: float
    engine_thread_cores: float
    event_s: float
    fill_latency_s: float
    fill_bandwidth_bytes_s: float
    background_cores: float = 0.0
    loop_poll_s: float = 0.0
    forward_nice: float = 0.0
    loop_rt: bool = False
    write_on_cpu: bool = False
    write_cpu_threads: int = 1
    write_rt: bool = False
    copy_op_s: float = 0.0
    fill_cpu_scale: float = 0.0  # 0: not measured (all of fill_scale is CPU)
    copy_cpu_scale: float = 0.0
    write_cpu_scale: float = 0.0
    fill_scale: float = 1.0
    copy_scale: float = 1.0
    control_scale: float = 1.0
    write_scale: float = 1.0
    event_scale: float = 1.0


@dataclass(frozen=True, slots=True)
class ResolvedLinks:
    """The profile merged with the [links] overrides, in SI units.

    `link` is the link KV transfers take for this placement (inter: NIC between
    nodes; intra: NVLink inside a node). `inter` / `intra` are None when the profile
    has no numbers for that class (e.g. the intra-node-only `nvlink` profile).
    """

    profile: str  # the name or path as written in the scenario
    profile_path: str | None  # the file read, None when every number was explicit
    source: str
    placement: Literal["inter", "intra"]
    link: LinkNumbers
    inter: LinkNumbers | None
    intra: LinkNumbers | None
    control_latency_s: float
    gpus_per_nic: int
    # a calibrated host's copy numbers and matmul rate; None: the catalogue GPU's
    mem_bandwidth_bytes_s: float | None = None
    kernel_launch_s: float | None = None
    gpu_flops: float | None = None
    host: HostNumbers | None = None  # None: the default GPU model (host_model absent or "gpu")


class _ProfileNumbers(_Table):
    """The numbers a hardware profile gives (PROFILE_FIELDS), all optional: the
    fields of a profile file, and the per-field overrides in [links]."""

    inter_bandwidth_gbps: PosFloat | None = None
    inter_latency_us: NonNegFloat | None = None
    inter_per_request_us: NonNegFloat | None = None
    intra_bandwidth_gbps: PosFloat | None = None
    intra_latency_us: NonNegFloat | None = None
    intra_per_request_us: NonNegFloat | None = None
    inter_prep_per_request_us: NonNegFloat | None = None
    inter_per_batch_us: NonNegFloat | None = None
    inter_message_rate_mps: NonNegFloat | None = None
    intra_prep_per_request_us: NonNegFloat | None = None
    intra_per_batch_us: NonNegFloat | None = None
    intra_message_rate_mps: NonNegFloat | None = None
    post_threads: Annotated[int, Field(ge=0, le=4096)] | None = None
    descriptor_reuse: bool | None = None
    control_latency_us: NonNegFloat | None = None
    gpus_per_nic: Annotated[int, Field(ge=1, le=1024)] | None = None
    mem_bandwidth_gbs: PosFloat | None = None
    kernel_launch_us: NonNegFloat | None = None
    gpu_tflops: PosFloat | None = None
    # host model (opt-in; see HOST_FIELDS): all five numbers are needed with "cpu-loop"
    host_model: HostModel | None = None
    host_cores: Annotated[float, Field(gt=0, le=1e6)] | None = None
    engine_thread_cores: Annotated[float, Field(ge=0, le=1e6)] | None = None
    event_us: NonNegFloat | None = None
    fill_latency_us: NonNegFloat | None = None
    fill_bandwidth_gbs: PosFloat | None = None
    background_cores: Annotated[float, Field(ge=0, le=1e6)] | None = None
    loop_poll_us: NonNegFloat | None = None
    forward_nice: Annotated[float, Field(ge=-20, le=39)] | None = None
    loop_rt: bool | None = None
    write_on_cpu: bool | None = None
    write_cpu_threads: Annotated[int, Field(ge=1, le=64)] | None = None
    write_rt: bool | None = None
    copy_op_us: Annotated[float, Field(ge=0, le=1e6)] | None = None
    fill_cpu_scale: PosFloat | None = None
    copy_cpu_scale: PosFloat | None = None
    write_cpu_scale: PosFloat | None = None
    fill_scale: PosFloat | None = None
    copy_scale: PosFloat | None = None
    control_scale: PosFloat | None = None
    write_scale: PosFloat | None = None
    event_scale: Annotated[float, Field(ge=1, le=1e6)] | None = None


def _looks_like_path(profile: str) -> bool:
    return "/" in profile or "\\" in profile or profile.endswith(".toml")


def profile_dirs(base_dir: str | Path | None = None) -> list[Path]:
    """Where a profile name is looked up, in order (duplicates removed).

    <scenario dir>/profiles, <scenario dir>/../profiles, then the repository's
    scenarios/profiles.
    """
    dirs: list[Path] = []
    if base_dir is not None:
        b = Path(base_dir)
        dirs += [b / "profiles", b.parent / "profiles"]
    dirs.append(REPO_PROFILES)
    seen: set[Path] = set()
    out = []
    for d in dirs:
        key = d.resolve()
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def available_profiles(base_dir: str | Path | None = None) -> list[str]:
    """Profile names that `links.profile` can name from a scenario in `base_dir`."""
    names: set[str] = set()
    for d in profile_dirs(base_dir):
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.toml"))
    return sorted(names)


class _ProfileFile(_ProfileNumbers):
    """A profile file: the [links] numbers plus where they come from."""

    source: str = ""


def _find_profile(profile: str, base_dir: Path | None) -> Path | None:
    if _looks_like_path(profile):
        p = Path(profile).expanduser()
        candidates = [p]
        if not p.is_absolute() and base_dir is not None:
            candidates.append(base_dir / p)
    else:
        candidates = [d / f"{profile}.toml" for d in profile_dirs(base_dir)]
    return next((c for c in candidates if c.is_file()), None)


def _read_profile(path: Path, profile: str) -> _ProfileFile:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise _FieldProblem({"profile": profile}, f"{path}: invalid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _FieldProblem({"profile": profile}, f"{path}: cannot read: {exc}") from None
    try:
        return _ProfileFile.model_validate(data)
    except ValidationError as exc:
        raise _FieldProblem(
            {"profile": profile}, str(_explain(exc, str(path), _ProfileFile))
        ) from None


def _resolve_links(
    links: LinksConfig, base_dir: str | Path | None
) -> tuple[dict[str, Any], ResolvedLinks]:
    """Merge profile file and overrides; check the numbers the placement needs exist."""
    path, merged, source = _merge_numbers(links, Path(base_dir) if base_dir is not None else None)
    if links.source is not None:
        source = links.source
    elif path is None:
        source = "explicit [links] numbers"
    inter, intra = _link_numbers(merged, "inter"), _link_numbers(merged, "intra")
    link = inter if links.placement == "inter" else intra
    host = _host_numbers(merged, links.profile)
    assert link is not None  # checked through the needed fields in _merge_numbers
    resolved = ResolvedLinks(
        profile=links.profile,
        profile_path=str(path.resolve()) if path is not None else None,
        source=source,
        placement=links.placement,
        link=link,
        inter=inter,
        intra=intra,
        control_latency_s=merged["control_latency_us"] / 1e6,
        gpus_per_nic=merged["gpus_per_nic"],
        mem_bandwidth_bytes_s=_scaled(merged.get("mem_bandwidth_gbs"), 1e9),
        kernel_launch_s=_scaled(merged.get("kernel_launch_us"), 1e-6),
        gpu_flops=_scaled(merged.get("gpu_tflops"), 1e12),
        host=host,
    )
    return merged, resolved


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale


def _merge_numbers(
    links: LinksConfig, bdir: Path | None
) -> tuple[Path | None, dict[str, Any], str]:
    """(profile file or None, its numbers with the [links] overrides on top, its source).

    Raises when the profile is not found and the overrides do not spell out every
    number the placement needs, or when a needed number is missing after the merge.
    """
    explicit = {k: getattr(links, k) for k in PROFILE_FIELDS if getattr(links, k) is not None}
    needed = (*_placement_fields(links.placement), *_COMMON_FIELDS)
    path = _find_profile(links.profile, bdir)
    merged: dict[str, Any] = {}
    source = ""
    if path is not None:
        pf = _read_profile(path, links.profile)
        merged = {k: getattr(pf, k) for k in PROFILE_FIELDS if getattr(pf, k) is not None}
        source = pf.source
    elif not all(k in explicit for k in needed):
        # Without a profile file, a scenario that spells out every number it needs
        # still loads (that is what to_toml writes); otherwise the name is wrong.
        where = "file not found" if _looks_like_path(links.profile) else "unknown profile"
        raise _FieldProblem(
            {"profile": links.profile},
            f"{where}; available: {', '.join(available_profiles(bdir)) or '(none)'} "
            f"(searched {', '.join(str(d) for d in profile_dirs(bdir))}; a path to a "
            ".toml file also works)",
        )
    merged.update(explicit)
    for key in needed:
        if merged.get(key) is None:
            raise _FieldProblem(
                {key: None},
                f"profile {links.profile!r} has no {key}, needed with placement = "
                f'"{links.placement}"; set links.{key} or choose another placement/profile',
            )
    return path, merged, source


def _link_numbers(merged: dict[str, Any], placement: str) -> LinkNumbers | None:
    """One link class in SI units, or None when the merged numbers lack it."""
    bw, lat, per = (merged.get(k) for k in _placement_fields(placement))
    if bw is None or lat is None or per is None:
        return None
    prep = (
        0.0
        if merged.get("descriptor_reuse")
        else merged.get(f"{placement}_prep_per_request_us") or 0.0
    )
    mps = merged.get(f"{placement}_message_rate_mps")
    return LinkNumbers(
        bw * 1e9 / 8,
        lat / 1e6,
        (per + prep) / 1e6 if prep else per / 1e6,
        (merged.get(f"{placement}_per_batch_us") or 0.0) / 1e6,
        mps * 1e6 if mps else math.inf,
        int(merged.get("post_threads") or 0),
    )


def _host_numbers(merged: dict[str, Any], profile: str) -> HostNumbers | None:
    """The cpu-loop host model in SI units; None with the default GPU model."""
    if merged.get("host_model", "gpu") != "cpu-loop":
        return None
    for key in HOST_REQUIRED[1:]:
        if merged.get(key) is None:
            raise _FieldProblem(
                {key: None},
                f'profile {profile!r} has host_model = "cpu-loop" but no {key}; '
                f"set links.{key} (kvstage calibrate writes all of {', '.join(HOST_REQUIRED)}) "
                'or host_model = "gpu"',
            )
    return HostNumbers(
        cores=float(merged["host_cores"]),
        engine_thread_cores=float(merged["engine_thread_cores"]),
        event_s=merged["event_us"] / 1e6,
        fill_latency_s=merged["fill_latency_us"] / 1e6,
        fill_bandwidth_bytes_s=merged["fill_bandwidth_gbs"] * 1e9,
        background_cores=float(merged.get("background_cores") or 0.0),
        loop_poll_s=(merged.get("loop_poll_us") or 0.0) / 1e6,
        forward_nice=float(merged.get("forward_nice") or 0.0),
        loop_rt=bool(merged.get("loop_rt") or False),
        write_on_cpu=bool(merged.get("write_on_cpu") or False),
        write_cpu_threads=int(merged.get("write_cpu_threads") or 1),
        write_rt=bool(merged.get("write_rt") or False),
        copy_op_s=(merged.get("copy_op_us") or 0.0) / 1e6,
        fill_cpu_scale=float(merged.get("fill_cpu_scale") or 0.0),
        copy_cpu_scale=float(merged.get("copy_cpu_scale") or 0.0),
        write_cpu_scale=float(merged.get("write_cpu_scale") or 0.0),
        fill_scale=float(merged.get("fill_scale") or 1.0),
        copy_scale=float(merged.get("copy_scale") or 1.0),
        control_scale=float(merged.get("control_scale") or 1.0),
        write_scale=float(merged.get("write_scale") or 1.0),
        event_scale=float(merged.get("event_scale") or 1.0),
    )


def links_table(links: LinksConfig) -> dict[str, Any]:
    """The [links] table with every number spelled out, as `Scenario.to_toml` writes it.

    The profile's numbers are written explicitly, so the table still loads where the
    profile file is not found (a run directory copied elsewhere).
    """
    r = links.resolved()
    profile = r.profile_path if r.profile_path and _looks_like_path(r.profile) else r.profile
    table: dict[str, Any] = {"profile": profile, "placement": r.placement, "source": r.source}
    for key in PROFILE_FIELDS:
        if links._merged.get(key) is not None:
            table[key] = links._merged[key]
    return table
