"""The config's unions, read from the models themselves: a section whose variant one key selects
(`type`; the synchronizer's `mode`), wherever it sits (placement, synchronizer, algorithm.advantage
and .loss, taskset.reward and .workflow, each eval set's reward, each tracker).

`loading.apply_overrides` uses them to switch a section's variant when a `set` override changes
its key (one rule for every union); the property test of that rule walks `unions()`, so a union
added to the config is covered by it without being listed anywhere.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import to_jsonable_python

ABSENT: Any = object()  # a key the section does not give


@dataclass(frozen=True)
class VariantUnion:
    """A union of config models told apart by the value of `key`."""

    key: str
    members: dict[str, type[BaseModel]]  # each value the key may take -> the model it selects
    other: type[BaseModel] | None  # the model any other name selects (a plugin's registered one), if any
    default: str | None  # the value a section without the key has (the synchronizer's `synchronous`)

    def member(self, value: Any) -> type[BaseModel] | None:
        """The model `value` of the key selects (ABSENT: the default's); None for a non-string."""
        if value is ABSENT:
            value = self.default
        if not isinstance(value, str):
            return None
        return self.members.get(value, self.other)

    def accepts(self, value: Any) -> bool:
        """Whether `value` names a variant (a built-in one, or a name the `other` model takes: registered)."""
        model = self.member(value)
        if model is None or value in self.members:
            return model is not None
        try:
            model.model_validate({self.key: value})
        except ValidationError as e:
            return not any(err["loc"] == (self.key,) for err in e.errors())
        return True


def _flat(annotation: Any) -> list[Any]:
    """The members of a union (Annotated and nested unions unwrapped); [annotation] for any other type."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _flat(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [m for a in get_args(annotation) for m in _flat(a)]
    return [annotation]


def _is_model(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def union_of(annotation: Any) -> VariantUnion | None:
    """The VariantUnion an annotation is (`None` members aside), or None: its key is the one field
    every member has, a Literal in each (its values apart from the others') or, in one member at
    most, any string."""
    models = [m for m in _flat(annotation) if m is not type(None)]
    if len(models) < 2 or not all(_is_model(m) for m in models):
        return None
    found = []
    for name in set.intersection(*(set(m.model_fields) for m in models)):
        members: dict[str, type[BaseModel]] = {}
        other, default, ok = None, None, True
        for m in models:
            field = m.model_fields[name]
            if get_origin(field.annotation) is Literal:
                values = get_args(field.annotation)
                ok = ok and not set(values) & set(members)
                members |= dict.fromkeys(values, m)
                if not field.is_required():
                    default = field.get_default()
            elif field.annotation is str and other is None:
                other = m
            else:
                ok = False
        if ok:
            found.append(VariantUnion(name, members, other, default))
    return found[0] if len(found) == 1 else None


def _resolve(annotation: Any, node: Any) -> Any:
    """The model a section with this annotation validates as, given its data: a union's member by
    its key, the model of an optional one; else the annotation itself (Annotated unwrapped)."""
    u = union_of(annotation)
    if u is not None:
        return u.member(node.get(u.key, ABSENT) if isinstance(node, dict) else ABSENT)
    members = [m for m in _flat(annotation) if m is not type(None)]
    if len(members) == 1:
        return members[0]
    return annotation


def annotation_at(path: tuple[str, ...] | list[str], data: Any, root: type[BaseModel] | None = None) -> Any:
    """The annotation of the field at dotted `path` (a list's items by index) of a raw config
    `data`, the unions on the way resolved by the data's keys; None where the models have no such
    field. A union at the end of the path is returned as it is (its variant is what is asked)."""
    if root is None:
        from rl_engine.config.root import RFTConfig

        root = RFTConfig
    annotation, node = root, data
    for part in path:
        t = _resolve(annotation, node)
        if _is_model(t):
            field = t.model_fields.get(part)
            if field is None:
                return None
            annotation, node = field.annotation, node.get(part) if isinstance(node, dict) else None
        elif get_origin(t) is list and part.isdigit():
            index = int(part)
            annotation = get_args(t)[0]
            node = node[index] if isinstance(node, list) and index < len(node) else None
        elif get_origin(t) is dict:
            annotation, node = get_args(t)[1], node.get(part) if isinstance(node, dict) else None
        else:
            return None
    return annotation


def unions(root: type[BaseModel] | None = None) -> Iterator[tuple[tuple[str, ...], VariantUnion]]:
    """Every union of the config: (the section's path, with `0` for a list's items; the union)."""
    if root is None:
        from rl_engine.config.root import RFTConfig

        root = RFTConfig
    seen: set[tuple[Any, ...]] = set()

    def walk(annotation: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], VariantUnion]]:
        u = union_of(annotation)
        if u is not None:
            yield path, u
        for t in _flat(annotation):
            if get_origin(t) is list:
                yield from walk(get_args(t)[0], (*path, "0"))
            elif _is_model(t) and (t, path) not in seen:
                seen.add((t, path))
                for name, field in t.model_fields.items():
                    yield from walk(field.annotation, (*path, name))

    yield from walk(root, ())


def variant_defaults(model: type[BaseModel], key: str, value: str) -> dict[str, Any]:
    """The fields of variant `value` (of `model`) when a section gives its key alone, as JSON
    values: what validating `{key: value}` fills in (a default that depends on the variant, as
    one_step_off_policy's sync_offset 1, included); the fields' own defaults where a variant needs
    more than its key (`type: python` needs its `function`)."""
    try:
        return model.model_validate({key: value}).model_dump(mode="json")
    except ValidationError:
        return {
            name: to_jsonable_python(f.get_default(call_default_factory=True))
            for name, f in model.model_fields.items()
            if not f.is_required()
        }
