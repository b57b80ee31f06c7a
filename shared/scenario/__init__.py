"""Scenario files: the pydantic schema, the TOML loader, overrides and a TOML writer.

A scenario (docs/reference.md, "Scenario sections") is the single input of both modes: the simulator
and the hardware driver read the same resolved `Scenario`, and a run directory stores
it back as TOML (`Scenario.to_toml`) so a run can be replayed exactly.

Bad input of any kind -- a TOML syntax error, an unknown key, a wrong type, a TP pair
the rank mapping cannot express, a staging pool too small for one chunk -- becomes one
`ScenarioError` whose message names the field as a dotted path (`decode.page_size`),
the value given and what is allowed. Callers print `str(err)`; nobody sees a pydantic
traceback.

One concern per module; import the public names from here:

    schema.py      the tables (ModelConfig, ..., Scenario) and their cross-field checks
    fieldtypes.py  the strict, frozen base table and the bounded number types
    presets.py     model presets (published KV geometry)
    profiles.py    hardware profile files, their lookup, and the resolved link numbers
    errors.py      ScenarioError, and pydantic errors turned into one clear message
    loading.py     load_scenario, read_scenario_file, scenario_from_dict, command-line overrides
    toml_out.py    the TOML writer (dumps_toml) behind Scenario.to_toml

Only the stdlib and pydantic are used (the `shared/` rule). File reads are the
loader's job; the schema itself stays a pure function of its input plus the profile
file it names.
"""

from __future__ import annotations

from kvstage.shared.faults import FaultsConfig
from kvstage.shared.scenario.errors import ScenarioError
from kvstage.shared.scenario.loading import (
    apply_overrides,
    load_scenario,
    parse_override_value,
    read_scenario_file,
    scaled,
    scenario_from_dict,
)
from kvstage.shared.scenario.presets import PRESETS, ModelPreset
from kvstage.shared.scenario.profiles import (
    HOST_FIELDS,
    PROFILE_FIELDS,
    REPO_PROFILES,
    HostNumbers,
    LinkNumbers,
    ResolvedLinks,
    available_profiles,
    profile_dirs,
)
from kvstage.shared.scenario.schema import (
    DecodeConfig,
    ExpectConfig,
    HardwareConfig,
    LinksConfig,
    ModelConfig,
    PrefillConfig,
    ScaleDown,
    Scenario,
    TransferConfig,
    WorkloadConfig,
)
from kvstage.shared.scenario.toml_out import dumps_toml

__all__ = [
    "HOST_FIELDS",
    "PRESETS",
    "PROFILE_FIELDS",
    "REPO_PROFILES",
    "DecodeConfig",
    "ExpectConfig",
    "FaultsConfig",
    "HardwareConfig",
    "HostNumbers",
    "LinkNumbers",
    "LinksConfig",
    "ModelConfig",
    "ModelPreset",
    "PrefillConfig",
    "ResolvedLinks",
    "ScaleDown",
    "Scenario",
    "ScenarioError",
    "TransferConfig",
    "WorkloadConfig",
    "apply_overrides",
    "available_profiles",
    "dumps_toml",
    "load_scenario",
    "parse_override_value",
    "profile_dirs",
    "read_scenario_file",
    "scaled",
    "scenario_from_dict",
]
