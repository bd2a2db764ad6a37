"""A request body checked against its msgspec `Struct` (gateway/api/bodies.py), refused with the gateway's 400s.

`validate(body, cls, rules)` converts the decoded body (a dict) into `cls` with msgspec: the accept path, in C.
When msgspec refuses it, `explain` walks the body against the Struct's declared types (`msgspec.inspect`), field
by field in declared order, and raises the first fault as the gateway's 400: the param as a path
(`messages[0].content[1].text`) and one of

- `Missing required parameter: 'x'.` (code `missing_required_parameter`),
- `Invalid type for 'x': expected <phrase>, got <type>.` (`invalid_type`; the phrase derived from the type: "a
  string", "an integer", ..., or the field's own),
- a range, length or enum message (`invalid_value`): `'x' must be between 0 and 2, got 3.` and the like.

A field words its faults itself through `Meta(extra=...)` (see `bodies.py`'s helpers): `expected` (the phrase
of its type faults), `invalid` (the message of a value of the right type out of range, of the wrong length or
not in the enum: a `str.format` template of `param` and `value`, or a function of both), `code` (that fault's
code), `all` (one (message, code) for every fault of the field, missing included), `missing="null"` (a missing
field is a type fault, `got null`) and `flat` (a fault inside the value is reported as a type fault of the
field itself).

Rules are the checks a type cannot state (one field requiring another, a mutual exclusion, a content block's
shape chosen by its `type`). Each is keyed to a Struct and a field, `{Struct: {field: rule}}`, and runs right after
that field (`field[]`: after each item of an array field), so the walk reports faults in one order whether a type
or a rule finds them. A rule takes the object (a dict; an item for `field[]`) and its param path and raises a
`GatewayError`; the parsers also run their rules on the accept path.

Only the types the bodies use are walked: str, int, float, bool, None, Literal, list, dict, Struct, unions of
these, Any. The body that goes upstream is the client's dict, never the Struct: msgspec ignores fields a Struct
does not declare, so they pass through to the engine as before.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Callable, Mapping, TypeVar

import msgspec
from msgspec import inspect as mi

from gateway.errors import GatewayError, bad_request

S = TypeVar("S", bound=msgspec.Struct)
Rule = Callable[[dict[str, Any], str], object]  # what it returns is not used by the walk
Rules = Mapping[type, Mapping[str, Rule]]
NO_RULES: Rules = {}


class Fault:
    """A value already known to be bad (a form field whose text is not a number, ...), put in the body in its
    place: msgspec refuses it and the walk raises its error where the field comes."""

    __slots__ = ("error",)

    def __init__(self, error: GatewayError) -> None:
        self.error = error


def validate(body: dict[str, Any], cls: type[S], rules: Rules = NO_RULES, param: str = "") -> S:
    """`body` as a `cls`, or the first fault in declared order as a 400 (`param`: the body's own path, when it
    is part of a larger body)."""
    try:
        return msgspec.convert(body, cls)
    except msgspec.ValidationError as e:
        explain(body, cls, rules, param)
        raise _unexplained(e, param) from None  # msgspec and the walk disagree: still a 400, never a 500


def explain(body: Any, cls: type[msgspec.Struct], rules: Rules = NO_RULES, param: str = "") -> None:
    """Raise the first fault of `body` as a `cls`, in declared order, rules included; return when none."""
    _walk(body, type_info(cls), param, {}, rules)


@functools.cache
def type_info(cls: Any) -> mi.Type:
    return mi.type_info(cls)


def struct_fields(cls: type[msgspec.Struct]) -> tuple[mi.Field, ...]:
    info = type_info(cls)
    assert isinstance(info, mi.StructType)
    return info.fields


def extra_of(t: mi.Type) -> dict[str, Any]:
    return (t.extra or {}) if isinstance(t, mi.Metadata) else {}


def core(t: mi.Type) -> mi.Type:
    """The type under its metadata and without its None (`Annotated[int, ...] | None` -> IntType)."""
    while isinstance(t, mi.Metadata):
        t = t.type
    if isinstance(t, mi.UnionType):
        rest = [m for m in t.types if not isinstance(m, mi.NoneType)]
        if len(rest) == 1:
            return core(rest[0])
    return t


# --- the walk -------------------------------------------------------------------------------------------------

def _sub(param: str, name: str) -> str:
    return f"{param}.{name}" if param else name


def _walk(v: Any, t: mi.Type, param: str, extra: dict[str, Any], rules: Rules, each: Rule | None = None) -> None:
    while isinstance(t, mi.Metadata):
        if t.extra:
            extra = {**extra, **t.extra}
        t = t.type
    if isinstance(v, Fault):
        raise v.error
    if isinstance(t, mi.UnionType):
        for m in t.types:
            if _kind_ok(m, v):
                return _walk(v, m, param, extra, rules, each)
        raise _type_fault(param, t, v, extra)
    if not _kind_ok(t, v):
        raise _type_fault(param, t, v, extra)
    if isinstance(t, (mi.IntType, mi.FloatType)):
        if not _in_range(t, v):
            raise _invalid(param, v, extra, _range_message(t))
    elif isinstance(t, mi.StrType):
        if (t.min_length is not None and len(v) < t.min_length) or (t.max_length is not None and len(v) > t.max_length) \
                or (t.pattern is not None and not re.search(t.pattern, v)):
            raise _invalid(param, v, extra, _length_message(t, "characters"))
    elif isinstance(t, mi.LiteralType):
        if v not in t.values:
            raise _invalid(param, v, extra, "'{param}' must be one of " + ", ".join(map(repr, t.values)) + ".")
    elif isinstance(t, mi.ListType):
        if (t.min_length is not None and len(v) < t.min_length) or (t.max_length is not None and len(v) > t.max_length):
            raise _invalid(param, v, extra, _length_message(t, "items"))
        for i, x in enumerate(v):
            try:
                _walk(x, t.item_type, f"{param}[{i}]", {}, rules)
            except GatewayError:
                if extra.get("flat"):
                    raise _type_fault(param, t, v, extra) from None
                raise
            if each is not None:
                each(x, f"{param}[{i}]")
    elif isinstance(t, mi.DictType):
        for k, x in v.items():
            _walk(x, t.value_type, f"{param}.{k}", {}, rules)
    elif isinstance(t, mi.StructType):
        own = rules.get(t.cls, {})
        for f in t.fields:
            sub = _sub(param, f.encode_name)
            if f.encode_name in v:
                _walk(v[f.encode_name], f.type, sub, {}, rules, own.get(f.name + "[]"))
            elif f.required:
                raise _missing(sub, f.type)
            rule = own.get(f.name)
            if rule is not None:
                rule(v, param)


def _kind_ok(t: mi.Type, v: Any) -> bool:
    """Whether `v` is of the JSON kind `t` takes (its constraints aside)."""
    while isinstance(t, mi.Metadata):
        t = t.type
    if isinstance(t, mi.AnyType):
        return True
    if isinstance(t, mi.NoneType):
        return v is None
    if isinstance(v, bool):
        return isinstance(t, mi.BoolType) or (isinstance(t, mi.LiteralType) and any(x is v for x in t.values))
    if isinstance(t, mi.BoolType):
        return False
    if isinstance(t, mi.IntType):
        return isinstance(v, int)
    if isinstance(t, mi.FloatType):
        return isinstance(v, (int, float))
    if isinstance(t, mi.StrType):
        return isinstance(v, str)
    if isinstance(t, mi.LiteralType):
        return any(type(x) is type(v) for x in t.values)
    if isinstance(t, mi.ListType):
        return isinstance(v, list)
    if isinstance(t, (mi.DictType, mi.StructType)):
        return isinstance(v, dict)
    if isinstance(t, mi.UnionType):
        return any(_kind_ok(m, v) for m in t.types)
    return True  # a type the walk does not model: left to msgspec's own account (`_unexplained`)


def _in_range(t: mi.IntType | mi.FloatType, v: float) -> bool:
    return not ((t.ge is not None and v < t.ge) or (t.gt is not None and v <= t.gt)
                or (t.le is not None and v > t.le) or (t.lt is not None and v >= t.lt))


_PHRASES: dict[type, str] = {mi.StrType: "a string", mi.IntType: "an integer", mi.FloatType: "a number",
                             mi.BoolType: "a boolean", mi.ListType: "an array", mi.DictType: "an object",
                             mi.StructType: "an object", mi.LiteralType: "a string", mi.NoneType: "null"}


def phrase(t: mi.Type) -> str:
    """What a type takes, as the error messages say it ("a string", "a string or an array")."""
    while isinstance(t, mi.Metadata):
        t = t.type
    if isinstance(t, mi.UnionType):
        rest = [m for m in t.types if not isinstance(m, mi.NoneType)]
        return " or ".join(dict.fromkeys(phrase(m) for m in rest))
    return _PHRASES.get(type(t), "a value")


def _got(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _all(param: str, v: Any, extra: dict[str, Any]) -> GatewayError | None:
    if "all" not in extra:
        return None
    message, code = extra["all"]
    return bad_request(_text(message, param, v), param=param, code=code)


def _text(message: str | Callable[[str, Any], str], param: str, v: Any) -> str:
    return message(param, v) if callable(message) else message.format(param=param, value=v)


def type_error(param: str, expected: str, v: Any) -> GatewayError:
    return bad_request(f"Invalid type for '{param}': expected {expected}, got {_got(v)}.", param=param,
                       code="invalid_type")


def _type_fault(param: str, t: mi.Type, v: Any, extra: dict[str, Any]) -> GatewayError:
    return _all(param, v, extra) or type_error(param, extra.get("expected") or phrase(t), v)


def _invalid(param: str, v: Any, extra: dict[str, Any], default: str) -> GatewayError:
    return _all(param, v, extra) or bad_request(_text(extra.get("invalid", default), param, v), param=param,
                                                code=extra.get("code", "invalid_value"))


def _missing(param: str, t: mi.Type) -> GatewayError:
    extra = extra_of(t)
    if "all" in extra or extra.get("missing") == "null":
        return _type_fault(param, t, None, extra)
    return bad_request(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")


def _range_message(t: mi.IntType | mi.FloatType) -> str:
    lo = t.ge if t.ge is not None else t.gt
    hi = t.le if t.le is not None else t.lt
    if t.ge is not None and t.le is not None:
        return f"'{{param}}' must be between {lo} and {hi}, got {{value}}."
    if lo is not None and hi is None:
        return f"'{{param}}' must be {'>=' if t.ge is not None else '>'} {lo}, got {{value}}."
    if hi is not None and lo is None:
        return f"'{{param}}' must be {'<=' if t.le is not None else '<'} {hi}, got {{value}}."
    return f"'{{param}}' must be within ({lo}, {hi}), got {{value}}."


def _length_message(t: mi.StrType | mi.ListType, unit: str) -> str:
    if t.min_length == 1 and t.max_length is None:
        return "'{param}' must not be empty."
    bounds = [f"at least {t.min_length}" if t.min_length is not None else "",
              f"at most {t.max_length}" if t.max_length is not None else ""]
    return f"'{{param}}' must have {' and '.join(b for b in bounds if b)} {unit}."


_AT = re.compile(r" - at `\$(.*)`$")


def _unexplained(e: msgspec.ValidationError, param: str) -> GatewayError:
    """msgspec's own account of a fault the walk did not find (a Struct using something the walk does not
    model): its path as the param, its words as the message."""
    text = str(e)
    m = _AT.search(text)
    path = (m.group(1) if m else "").lstrip(".")
    where = (f"{param}.{path}" if param and path and not path.startswith("[") else param + path) or None
    return bad_request(f"Invalid request body: {_AT.sub('', text)}" + (f" (at '{where}')." if where else "."),
                       param=where, code="invalid_value")
