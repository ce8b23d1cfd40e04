"""EngineConfig as command-line flags: one flag per field, named after it (`tensor_parallel_size`
is `--tensor-parallel-size`), so the CLI cannot drift from the config; `--speculative` takes its
settings as a JSON object (vLLM's --speculative-config form). The KV budget is the one flag that is
not a field: `--kv-cache` takes a fraction or a size (shoal.sizes.parse_kv_cache).

Flags left out keep the config's defaults; `--engine-config JSON` gives a whole config instead
(what `shoal serve` ships to its workers) and then no other engine flag may be given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from shoal.config.engine import EngineConfig
from shoal.sizes import parse_kv_cache

KV_BUDGET_FIELDS = ("kv_cache_bytes", "kv_cache_fraction")
_SCALARS = {"str": str, "int": int, "float": float}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _comma_list(item_type: type):
    def parse(text: str) -> tuple:
        try:
            return tuple(item_type(part.strip()) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a comma-separated list of {item_type.__name__}"
            ) from None

    return parse


def _kv_cache(text: str) -> dict:
    try:
        return parse_kv_cache(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def _engine_fields(exclude: tuple[str, ...]) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if f.name not in (*exclude, *KV_BUDGET_FIELDS)]


def add_engine_config_arguments(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """Adds --engine-config, --kv-cache and a flag for every other EngineConfig field not in `exclude`."""
    group = parser.add_argument_group("engine", "EngineConfig fields (shoal.engine.config)")
    group.add_argument(
        "--engine-config",
        default=None,
        metavar="JSON",
        help="the whole engine config as JSON (then no other engine flag)",
    )
    group.add_argument(
        "--kv-cache",
        type=_kv_cache,
        default=None,
        help="KV-cache budget: a fraction of free memory (0.3) or a size (512MiB, 2GB)",
    )
    for field in _engine_fields(exclude):
        annotation = str(field.type).replace(" | None", "")
        if annotation == "bool":
            group.add_argument(
                _flag(field.name), action=argparse.BooleanOptionalAction, default=None, help=f"default {field.default}"
            )
        elif annotation.startswith("tuple["):
            item = int if annotation.startswith("tuple[int") else str
            group.add_argument(
                _flag(field.name), type=_comma_list(item), default=None, metavar="A,B,...", help="comma-separated"
            )
        elif annotation == "SpeculativeConfig":
            group.add_argument(
                _flag(field.name), type=_json_object, default=None, metavar="JSON", help='{"method": "ngram", ...}'
            )
        elif annotation in _SCALARS:
            group.add_argument(
                _flag(field.name), type=_SCALARS[annotation], default=None, help=f"default {field.default}"
            )
        else:
            raise TypeError(f"EngineConfig.{field.name}: no command-line form for {annotation}")


def engine_config_from_arguments(args: argparse.Namespace, exclude: tuple[str, ...] = ()) -> EngineConfig:
    """The config the flags describe (ValueError for a bad combination or value)."""
    given = {f.name: getattr(args, f.name) for f in _engine_fields(exclude) if getattr(args, f.name, None) is not None}
    if args.kv_cache:
        given.update(args.kv_cache)
    if args.engine_config is not None:
        if given:
            raise ValueError(
                f"--engine-config gives the whole engine config; do not also give "
                f"{', '.join(_flag(name) for name in sorted(given))}"
            )
        return EngineConfig.from_json(args.engine_config)
    return EngineConfig.from_dict(given)
