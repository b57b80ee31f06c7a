"""Loading scenarios: a TOML file or parsed dict in, a validated `Scenario` out, with
"dotted.key=value" command-line overrides (`--set`) applied on the way.

Every failure -- a missing file, a TOML syntax error, an override naming no field,
any schema problem, a bad trace CSV -- is raised as one ScenarioError (errors.py).
File reads are this module's job; the schema itself reads only the profile file it
names. A scenario whose workload uses `workload.trace` has that file read here
(trace_csv.py), so a bad trace fails the load, not the run.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationError

from kvstage.shared.scenario.errors import ScenarioError, _explain, _fmt_value
from kvstage.shared.scenario.schema import Scenario
from kvstage.shared.scenario.trace_csv import read_trace
from kvstage.shared.serving.kernel_table import KernelTableError, kernel_table

__all__ = [
    "apply_overrides",
    "load_scenario",
    "parse_override_value",
    "read_scenario_file",
    "scaled",
    "scenario_from_dict",
]


def scenario_from_dict(
    data: Mapping[str, Any], base_dir: str | Path | None = None, *, source: str | None = None
) -> Scenario:
    """Validate a scenario given as nested dicts (parsed TOML).

    `base_dir` anchors relative paths (profile, trace CSV) and the profile search;
    `source` (a file name) prefixes error messages. The trace CSV, when the workload
    uses one, is read and checked too.
    """
    if not isinstance(data, Mapping):
        raise ScenarioError(f"{source or 'scenario'}: expected a table, got {_fmt_value(data)}")
    context = {"base_dir": Path(base_dir) if base_dir is not None else None}
    try:
        scenario = Scenario.model_validate(dict(data), context=context)
    except ValidationError as exc:
        raise _explain(exc, source, Scenario) from None
    _check_trace(scenario, source)
    _check_kernels(scenario, source)
    return scenario


def _check_kernels(scenario: Scenario, source: str | None) -> None:
    """Read the kernel table once (serving.kernels), so that a bad one is a load error."""
    if scenario.serving.kernels is None:
        return
    try:
        scenario.serving.keep_table(kernel_table(scenario))
    except KernelTableError as exc:
        prefix = f"{source}: " if source else ""
        raise ScenarioError(f"{prefix}serving.kernels: {exc}", "serving.kernels") from None


def _check_trace(scenario: Scenario, source: str | None) -> None:
    """Read the workload's trace once, so that a bad one is a load error; the scenario
    keeps its rows (`WorkloadConfig.rows`): nothing reads the file again."""
    w = scenario.workload
    if not w.uses_trace:
        return
    try:
        w.keep_rows(read_trace(w.trace))
    except ScenarioError as exc:
        prefix = f"{source}: " if source else ""
        raise ScenarioError(f"{prefix}workload.trace: {exc}", "workload.trace") from None


def load_scenario(path: str | Path, overrides: Sequence[str] = ()) -> Scenario:
    """Read a scenario TOML file, apply "dotted.key=value" overrides, validate.

    `name` defaults to the file stem. Raises ScenarioError for any bad input.
    """
    p = Path(path)
    data = apply_overrides(read_scenario_file(p), overrides)
    data.setdefault("name", p.stem)
    return scenario_from_dict(data, p.parent, source=str(p))


def read_scenario_file(path: str | Path) -> dict[str, Any]:
    """A scenario TOML file's tables as parsed, before any override or validation (what
    `load_scenario` starts from; a sweep applies each point's overrides to it). Raises
    ScenarioError when the file is missing, unreadable or not TOML."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ScenarioError(f"{p}: no such scenario file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{p}: invalid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{p}: cannot read: {exc}") from None
    if "serving" in data:
        _merge_serving_profile(p, data)
    return data


# What a serving profile (`kvstage calibrate --fit-serving --from`, docs/workflow.md) may set
SERVING_PROFILE_KEYS = {"prefill": ("mfu",), "decode": ("hbm_efficiency", "step_overhead_ms")}


def _merge_serving_profile(p: Path, data: dict[str, Any]) -> None:
    """`[serving] profile = "FILE"` (relative to the scenario): the profile's fitted keys
    under the scenario's own (the scenario's win); the [serving] table goes, so the
    resolved scenario holds the values and loads without the profile."""
    table = data.get("serving")
    if not isinstance(table, dict) or not set(table) <= {"profile", "kernels"}:
        raise ScenarioError(
            f'{p}: [serving] takes profile = "FILE" (a serving profile) and kernels = '
            '"FILE.csv" (a kernel table)'
        )
    if "profile" not in table:
        return
    table = dict(table)
    prof = p.parent / str(table.pop("profile"))
    if table:
        data["serving"] = table
    else:
        del data["serving"]
    try:
        with prof.open("rb") as fh:
            fitted = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{p}: serving.profile {prof}: cannot read it ({exc})") from None
    for name, values in fitted.items():
        allowed = SERVING_PROFILE_KEYS.get(name, ())
        bad = [k for k in (values if isinstance(values, dict) else {"?": 0}) if k not in allowed]
        if bad:
            raise ScenarioError(
                f"{prof}: [{name}] {', '.join(bad)}: a serving profile sets only "
                + "; ".join(f"{t}.{k}" for t, ks in SERVING_PROFILE_KEYS.items() for k in ks)
            )
        own = data.setdefault(name, {})
        for key, value in values.items():
            own.setdefault(key, value)


def parse_override_value(raw: str) -> Any:
    """An override value as a TOML value (512, 1.5, true, "x", [1, 2]), else the bare string."""
    try:
        doc = tomllib.loads(f"v = {raw}")
    except tomllib.TOMLDecodeError:
        return raw
    return doc["v"] if set(doc) == {"v"} else raw


def _is_str_field(annotation: Any) -> bool:
    if annotation is str:
        return True
    return get_origin(annotation) is not None and str in get_args(annotation)


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of `data` with each "dotted.key=value" override set.

    Keys are checked against the schema, so a typo fails here with the allowed keys
    at that level instead of being silently added. A value for a string field is
    kept as typed (so `name=123` is the string "123").
    """
    out = _deep_copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or not key or not all(parts):
            raise ScenarioError(
                f"override {item!r}: expected dotted.key=value, e.g. decode.page_size=32"
            )
        value: Any = parse_override_value(raw.strip())
        cls: type[BaseModel] | None = Scenario
        node = out
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            where = f"[{'.'.join(parts[:i])}]" if i else "the top level"
            if cls is not None:
                field = cls.model_fields.get(part)
                refused = getattr(cls, "REFUSED_KEYS", {}).get(part)
                if field is None and refused is not None:  # a key with its own reason
                    raise ScenarioError(f"override {item!r}: {refused}", key)
                if field is None:
                    if cls.model_config.get("extra") == "allow":
                        cls = None  # free-form table ([faults]): any key
                    else:
                        raise ScenarioError(
                            f"override {item!r}: unknown key {part!r} in {where}; allowed: "
                            f"{', '.join(cls.model_fields)}",
                            key,
                        )
                else:
                    ann = field.annotation
                    sub = _table_type(ann)
                    if last and _is_str_field(ann) and not isinstance(value, str):
                        value = raw.strip()
                    if not last and sub is None and get_origin(ann) is dict:
                        # a mapping field (faults.drop.WATERMARK=0.01): keys are
                        # checked by the schema when the scenario validates
                        cls = None
                        node = node.setdefault(part, {})
                        continue
                    if not last and sub is None:
                        raise ScenarioError(
                            f"override {item!r}: {'.'.join(parts[: i + 1])} is a value, "
                            "not a table",
                            key,
                        )
                    cls = sub
            if last:
                node[part] = value
            else:
                child = node.setdefault(part, {})
                if not isinstance(child, dict):
                    raise ScenarioError(
                        f"override {item!r}: {'.'.join(parts[: i + 1])} is "
                        f"{_fmt_value(child)}, not a table",
                        key,
                    )
                node = child
    return out


def _table_type(ann: Any) -> type[BaseModel] | None:
    """The table class of a field: the annotation itself, or the table of an optional
    table (`X | None`, e.g. decode.speculative); None for a value or a mapping."""
    if get_origin(ann) is dict:
        return None
    for t in (ann, *get_args(ann)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def scaled(s: Scenario) -> Scenario:
    """Scenario `s` with [hardware.scale_down] applied, or itself when disabled.

    Sizes only shrink (each is min(current, scale-down value)); TP sizes, KV
    heads, head_dim and page size stay, so the rank mapping under test is the
    same. params_b shrinks with the layer count so the modeled forward time stays
    per-layer faithful.
    """
    sd = s.hardware.scale_down
    if not sd.enabled:
        return s
    data = s.model_dump(exclude_none=True)
    if sd.layers is not None and sd.layers < s.model.layers:
        data["model"]["layers"] = sd.layers
        for key in ("params_b", "active_params_b"):
            if key in data["model"]:
                data["model"][key] = data["model"][key] * sd.layers / s.model.layers
    if sd.requests is not None:
        given = s.workload.requests  # None: every trace row
        data["workload"]["requests"] = sd.requests if given is None else min(given, sd.requests)
    if sd.max_prompt_tokens is not None:
        cap = sd.max_prompt_tokens
        w = data["workload"]
        if s.workload.max_prompt_tokens is not None:
            cap = min(cap, s.workload.max_prompt_tokens)
        w["max_prompt_tokens"] = cap
        for key in ("prompt_tokens", "prompt_min", "prompt_max"):
            w[key] = min(w[key], cap)
    if sd.staging_pool_mb is not None:
        data["decode"]["staging_pool_mb"] = min(s.decode.staging_pool_mb, sd.staging_pool_mb)
    if sd.chunked_prefill_size is not None:
        data["prefill"]["chunked_prefill_size"] = min(
            s.prefill.chunked_prefill_size, sd.chunked_prefill_size
        )
    return scenario_from_dict(data, s.base_dir, source=f"{s.name} (scaled down)")
