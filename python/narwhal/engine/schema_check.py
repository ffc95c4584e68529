"""A client's JSON Schema checked against the meta-schema before anything compiles it."""

from __future__ import annotations

from typing import Any

from narwhal.errors import invalid


def check_schema(schema: dict[str, Any], where: str) -> None:
    """A JSON Schema that is not one (`{"type": 5}`, `properties` as a list) is a 400 naming
    the place in it, before a converter or a validator sees it (they assume a valid one)."""
    import jsonschema_rs

    try:
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as e:
        inner = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.instance_path)
        raise invalid(
            f"not a valid JSON Schema at {where}{inner}: {e.message}", where + inner
        ) from None
    except Exception as e:  # a $ref it cannot resolve, say
        raise invalid(f"not a valid JSON Schema: {e}", where) from None
