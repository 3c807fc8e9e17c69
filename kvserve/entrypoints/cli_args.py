"""argparse flags generated from the EngineArgs dataclass, so the CLI and the library never drift."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from kvserve.config import EngineArgs


def _scalar(tp):
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if args else str
    return tp


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("model",)) -> None:
    hints = typing.get_type_hints(EngineArgs)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(EngineArgs):
        if f.name in skip:
            continue
        group_name = f.metadata.get("group", "Engine")
        group = groups.get(group_name) or groups.setdefault(group_name, parser.add_argument_group(f"{group_name} options"))
        flag = "--" + f.name.replace("_", "-")
        flags = [flag, *f.metadata.get("aliases", [])]
        tp = _scalar(hints[f.name])
        help_text = f.metadata.get("help", "")
        if tp is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            group.add_argument(*flags, type=tp, default=f.default, help=f"{help_text} (default: {f.default})")


def engine_args_from_namespace(ns: argparse.Namespace, model: str | None) -> EngineArgs:
    kwargs = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(ns, f.name)}
    kwargs["model"] = model
    return EngineArgs(**kwargs)
