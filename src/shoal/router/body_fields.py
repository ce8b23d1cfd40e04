"""Reading the fields of a JSON request body that the router validates itself (the Responses and
Messages APIs): a field has its type or the request is a 400 naming it."""

from __future__ import annotations

from shoal.router.placement.route_request import RequestError


def typed_field(body: dict, name: str, kind: type | tuple[type, ...], description: str, default=None):
    """body[name] when it has the type (null counts as absent); booleans are not numbers here."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise RequestError(f"`{name}` must be {description}", name)
    return value


def number_in_range(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    """body[name], a number in [low, high] (or (low, high] with `low_open`), or None."""
    value = typed_field(body, name, (int, float), "a number")
    if value is not None and not (low < value <= high if low_open else low <= value <= high):
        raise RequestError(f"`{name}` must be in {'(' if low_open else '['}{low}, {high}]", name)
    return value


MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


def metadata_field(body: dict, default=None) -> dict[str, str] | None:
    """OpenAI's `metadata` (responses, stored chat completions, batches): at most 16 string
    values under keys of up to 64 characters, values up to 512; `default` when absent or null."""
    metadata = typed_field(body, "metadata", dict, "an object of string values", default)
    if metadata and (
        len(metadata) > MAX_METADATA_KEYS
        or not all(
            isinstance(v, str) and len(k) <= MAX_METADATA_KEY_CHARS and len(v) <= MAX_METADATA_VALUE_CHARS
            for k, v in metadata.items()
        )
    ):
        raise RequestError(
            f"`metadata` takes at most {MAX_METADATA_KEYS} keys of up to {MAX_METADATA_KEY_CHARS} "
            f"characters with string values of up to {MAX_METADATA_VALUE_CHARS}",
            "metadata",
        )
    return metadata


def known_fields(body: object, allowed: set[str]) -> dict:
    """The body, a JSON object of `allowed` fields only (the first other one is named) and a model."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(f"unknown or unsupported parameter `{unknown[0]}`", unknown[0])
    if not typed_field(body, "model", str, "a non-empty string", ""):
        raise RequestError("`model` is required and must be a non-empty string", "model")
    return body
