"""Scenario errors: one `ScenarioError` with one clear message for any bad input.

Validators raise `_FieldProblem` (the precise field path(s), the values and the
reason); `_explain` turns a pydantic ValidationError -- including those -- into a
ScenarioError whose message names each field as a dotted path (`decode.page_size`),
the value given and what is allowed, one line per problem. Nobody sees a pydantic
traceback.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from kvstage.shared.scenario.presets import PRESETS
from kvstage.shared.scenario.toml_out import _toml_value

__all__ = ["ScenarioError"]


class ScenarioError(ValueError):
    """Bad scenario input, with one message meant for a human (no traceback needed).

    `field` is the dotted path of the (first) offending field when one is known;
    `own_values` the dotted paths of the fields whose value alone the schema rejects (a
    wrong type, out of range, a field validator), as opposed to a check across fields,
    which pydantic reports at the table (a sweep tells bad input from a bad combination
    with it).
    """

    def __init__(
        self, message: str, field: str | None = None, own_values: Sequence[str] = ()
    ) -> None:
        super().__init__(message)
        self.field = field
        self.own_values = tuple(own_values)


class _FieldProblem(ValueError):
    """Raised inside validators so that the error keeps its field path and value.

    Pydantic wraps a ValueError from a validator into a `value_error` whose location
    is the model being validated; for a cross-field check that location is too coarse
    (`decode` instead of `decode.prefix_tokens`). This carries the precise field(s),
    relative to that location, through pydantic to `_explain`.
    """

    def __init__(self, fields: Mapping[str, Any], reason: str) -> None:
        super().__init__(reason)
        self.fields = dict(fields)
        self.reason = reason


def _fmt_value(value: Any) -> str:
    """A value as the user would write it in TOML, shortened in the middle when long: a
    long path keeps its file name, a long list its last items."""
    try:
        text = _toml_value(value)
    except TypeError:
        text = repr(value)
    return text if len(text) <= 80 else text[:38] + "..." + text[-39:]


def _join(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _table_at(loc: Sequence[Any], root: type[BaseModel]) -> type[BaseModel] | None:
    """The model class of the table at `loc`, or None if it is not a known table."""
    cls: type[BaseModel] = root
    for part in loc:
        field = cls.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        cls = ann
    return cls


def _explain_one(err: Mapping[str, Any], root: type[BaseModel]) -> tuple[str, str]:
    """(field path, one line) for one pydantic error."""
    loc = list(err.get("loc", ()))
    ctx = err.get("ctx") or {}
    problem = ctx.get("error")
    if isinstance(problem, _FieldProblem):
        parts = []
        first = None
        for rel, value in problem.fields.items():
            path = rel if "." in rel else _join([*loc, rel])
            first = first or path
            parts.append(f"{path} = {_fmt_value(value)}" if value is not None else path)
        return first or _join(loc), f"{', '.join(parts)}: {problem.reason}"
    path = _join(loc) or "(scenario)"
    kind = err.get("type")
    if kind == "extra_forbidden":
        table = _table_at(loc[:-1], root)
        where = f"[{_join(loc[:-1])}]" if loc[:-1] else "the top level"
        allowed = ", ".join(table.model_fields) if table is not None else "?"
        return path, f"{path}: unknown key; allowed keys in {where}: {allowed}"
    if kind == "missing":
        if loc[:1] == ["model"] and len(loc) == 2:
            return path, (
                f"{path}: missing; set model.preset (one of: {', '.join(PRESETS)}) or give "
                "model.layers, model.kv_heads, model.head_dim and model.params_b "
                '(MLA: model.attention = "mla" and model.latent_dim instead of kv_heads '
                "and head_dim)"
            )
        return path, f"{path}: missing (required)"
    msg = str(err.get("msg", "invalid"))
    msg = msg.removeprefix("Value error, ")
    if kind == "model_type":
        msg = "expected a table"
    return path, f"{path} = {_fmt_value(err.get('input'))}: {msg}"


def _explain(exc: ValidationError, source: str | None, root: type[BaseModel]) -> ScenarioError:
    """One ScenarioError for a pydantic ValidationError: one line per problem.

    `source` (a file name) prefixes the message; `root` is the model that was
    validated (`Scenario`, a profile file), for the allowed keys of a table.
    """
    lines: list[str] = []
    first_field = None
    own: list[str] = []  # errors at a value, not at a table (a cross-field check)
    for err in exc.errors(include_url=False):
        field, line = _explain_one(err, root)
        first_field = first_field or field
        if line not in lines:
            lines.append(line)
        loc = err.get("loc", ())
        if _table_at(loc, root) is None:
            own.append(".".join(str(p) for p in loc))
    prefix = f"{source}: " if source else ""
    if len(lines) == 1:
        return ScenarioError(prefix + lines[0], first_field, own)
    body = "\n".join(f"  {line}" for line in lines)
    return ScenarioError(f"{prefix}{len(lines)} problems:\n{body}", first_field, own)
