"""JSON as the standard has it: a non-finite number (a NaN loss) is written as null, since
Python's ``json`` would write ``NaN``, which no strict reader (jq, JavaScript) accepts."""

from __future__ import annotations

import json
import math


def finite(obj):
    """``obj`` with every non-finite float (at any depth of dicts, lists, tuples) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj, **kwargs) -> str:
    return json.dumps(finite(obj), allow_nan=False, **kwargs)
