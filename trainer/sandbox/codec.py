"""Values across the sandbox boundary as data: tagged JSON, never pickle.

The code reward's judge calls the candidate's functions in the sandbox with encoded arguments and
reads back encoded results; both sides use this module (the sandbox gets its source). Plain types
only, matched exactly (a subclass with its own `__eq__` is refused, so a result cannot claim to
equal anything): None, bool, int, float (nan and infinities included), complex, str, bytes, and
lists, tuples, sets, frozensets and dicts of them, at most `MAX_DEPTH` deep. Anything else is
`Unsendable`, named by its type.
"""
import math

MAX_DEPTH = 64


class Unsendable(ValueError):
    pass


def encode(value, depth=0):
    if depth > MAX_DEPTH:
        raise Unsendable(f"a value nested more than {MAX_DEPTH} deep")
    t = type(value)
    if value is None or t is bool or t is str or t is int:
        return value
    if t is float:
        return value if math.isfinite(value) else {"$float": repr(value)}
    if t is list:
        return [encode(v, depth + 1) for v in value]
    if t in _TAGS:
        return {_TAGS[t]: [encode(v, depth + 1) for v in value]}
    if t is dict:
        return {"$dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if t is bytes:
        return {"$bytes": value.hex()}
    if t is complex:
        return {"$complex": [encode(value.real), encode(value.imag)]}
    raise Unsendable(f"a value of type {t.__name__}")


_TAGS = {tuple: "$tuple", set: "$set", frozenset: "$frozenset"}
_MAKE = {"$tuple": tuple, "$set": set, "$frozenset": frozenset}


def decode(data, depth=0):
    """The value `encode` gave `data` for (ValueError on anything it could not have written)."""
    if depth > MAX_DEPTH + 1:
        raise ValueError("nested too deeply")
    t = type(data)
    if data is None or t in (bool, str, int, float):
        return data
    if t is list:
        return [decode(v, depth + 1) for v in data]
    if t is dict and len(data) == 1:
        (tag, body), = data.items()
        if tag in _MAKE and type(body) is list:
            return _MAKE[tag](decode(v, depth + 1) for v in body)
        if tag == "$dict" and type(body) is list:
            return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
        if tag == "$float" and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag == "$bytes" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "$complex" and type(body) is list and len(body) == 2:
            return complex(float(body[0]), float(body[1]))
    raise ValueError(f"not an encoded value: {str(data)[:80]!r}")
