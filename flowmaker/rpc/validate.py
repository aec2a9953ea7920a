"""Edge validation of every request: one walk over the decoded message, before any servicer code runs.

Checks, each raising InvalidSpec / LimitExceeded naming the field by its full path
(`workflows[0].stages[0].kind`):

- every enum value is one the API defines (proto3 keeps unknown numbers; the domain cannot);
- every float/double is finite;
- every field with a rule in `flowmaker.limits.FIELD_RULES` obeys it (ids, sizes, counts, ranges,
  prompt templates, JSON depth);
- every other string stays under `default_string_bytes` and every other repeated field under
  `default_repeated`, so no unbounded input reaches the services.

Counts are checked before a repeated field's elements are walked, so a 10,000-stage request costs
one length check, not 10,000 validations.
"""

from __future__ import annotations

import math
from typing import Any

from google.protobuf import descriptor as _d
from google.protobuf.message import Message

from flowmaker.cancel import checkpoint
from flowmaker.errors import InvalidSpec
from flowmaker.limits import (
    FIELD_RULES,
    LIMITS,
    MESSAGE_RULES,
    Limits,
    apply_rule,
    check_bytes,
    check_count,
    check_message_bytes,
)

_FLOATS = (_d.FieldDescriptor.TYPE_DOUBLE, _d.FieldDescriptor.TYPE_FLOAT)
_STRINGS = (_d.FieldDescriptor.TYPE_STRING, _d.FieldDescriptor.TYPE_BYTES)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def validate_request(msg: Message, limits: Limits = LIMITS) -> None:
    """Raise InvalidSpec for the first field of `msg` that breaks a rule; only FlowMaker messages are
    walked (health and reflection requests pass as they are)."""
    if not msg.DESCRIPTOR.full_name.startswith("flowmaker."):
        return
    _walk(msg, "", limits)
    # After the fields: a request too big because of one field names that field and its own limit.
    whole = MESSAGE_RULES.get(msg.DESCRIPTOR.full_name)
    if whole is not None:
        check_message_bytes(msg.ByteSize(), whole[1], whole[0], limits)


def _walk(msg: Message, path: str, limits: Limits) -> None:
    checkpoint()  # run in a worker for big requests (flowmaker.rpc.errors): stop once the caller has gone
    for fd, value in msg.ListFields():
        fpath = _join(path, fd.name)
        rules = FIELD_RULES.get(fd.full_name, ())
        if fd.is_repeated:
            if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
                check_count(len(value), fpath, "default_repeated", limits)
                vfd = fd.message_type.fields_by_name["value"]
                for k, v in value.items():
                    check_bytes(str(k), f"{fpath}[key]", "default_string_bytes", limits)
                    _value(vfd, v, f"{fpath}[{str(k)[:32]!r}]", (), limits)
                continue
            if not any(r[0] == "count" for r in rules):
                check_count(len(value), fpath, "default_repeated", limits)
            for r in rules:
                apply_rule(r, value, fpath, limits)
            each = FIELD_RULES.get(fd.full_name + "[]", ())
            for i, v in enumerate(value):
                _value(fd, v, f"{fpath}[{i}]", each, limits)
        else:
            _value(fd, value, fpath, rules, limits)


def _value(fd: _d.FieldDescriptor, value: Any, path: str, rules: tuple[Any, ...], limits: Limits) -> None:
    if fd.message_type is not None:
        if fd.message_type.full_name.startswith("flowmaker."):
            _walk(value, path, limits)
        return
    if fd.enum_type is not None:
        if fd.enum_type.values_by_number.get(value) is None:
            allowed = ", ".join(v.name for v in fd.enum_type.values)
            raise InvalidSpec(f"unknown enum value {value}; one of {allowed}", field=path, reason="INVALID_ENUM")
        return
    if fd.type in _FLOATS:
        if not math.isfinite(value):
            raise InvalidSpec(f"must be a finite number, got {value}", field=path, reason="NOT_FINITE")
    elif fd.type in _STRINGS and not any(r[0] in ("bytes", "json", "template", "id", "etag") for r in rules):
        check_bytes(value if isinstance(value, str) else value.decode("latin-1"), path, "default_string_bytes",
                    limits)
    for r in rules:
        apply_rule(r, value, path, limits)
