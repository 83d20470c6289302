"""Kubernetes quantities (``100Gi``, ``8Gi``, ``500m``), checked when a platform block is created (pure).

A block with ``shm_size="8GB"`` used to be saved without complaint and refused by the API server only when
the training stage submitted its MPIJob — after the dataset stage may have run for hours. The grammar is
apimachinery's (``pkg/api/resource/quantity.go``, the ``Quantity`` doc comment)::

    <quantity>        ::= <signedNumber><suffix>
    <number>          ::= <digits> | <digits>.<digits> | <digits>. | .<digits>
    <suffix>          ::= <binarySI> | <decimalExponent> | <decimalSI>
    <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei
    <decimalSI>       ::= m | "" | k | M | G | T | P | E
    <decimalExponent> ::= "e" <signedNumber> | "E" <signedNumber>

(the parser, ``pkg/api/resource/suffix.go``, also takes ``n`` and ``u`` as decimal suffixes).
"""

from __future__ import annotations

import re
from decimal import Decimal

_GRAMMAR = re.compile(r"^(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+))"
                      r"(?P<suffix>[eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|)$")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {suffix: Decimal(10) ** exponent for suffix, exponent in
            (("n", -9), ("u", -6), ("m", -3), ("", 0), ("k", 3), ("M", 6), ("G", 9), ("T", 12), ("P", 15), ("E", 18))}
HINT = ("write a number with an optional suffix: Ki, Mi, Gi, Ti (powers of 1024) or k, M, G, T (powers of 1000), "
        "e.g. 8Gi or 500Gi")


class InvalidQuantity(ValueError):
    """A string the Kubernetes API server would refuse as a quantity."""


def parse_quantity(text: str, what: str = "quantity") -> Decimal:
    """The value of a Kubernetes quantity (bytes for sizes), or an error naming ``what`` and the fix."""
    match = _GRAMMAR.match(text) if isinstance(text, str) else None
    if match is None:
        raise InvalidQuantity(f"{what} {text!r} is not a Kubernetes quantity: {HINT}")
    number, suffix = Decimal(match["number"]), match["suffix"]
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        return number * Decimal(10) ** int(suffix[1:])
    return number * (_BINARY[suffix] if suffix in _BINARY else _DECIMAL[suffix])


def validate_size(text: str, what: str) -> str:
    """``text`` if it is a positive, whole number of bytes (what a volume or tmpfs size must be)."""
    value = parse_quantity(text, what)
    if value <= 0:
        raise InvalidQuantity(f"{what} {text!r} must be more than 0 bytes: {HINT}")
    if value != value.to_integral_value():
        raise InvalidQuantity(f"{what} {text!r} is a fraction of a byte: {HINT}")
    return text


def larger_size(first: str, second: str) -> str:
    """The larger of two quantities, as written (a restore asks for at least its snapshot's size)."""
    return second if parse_quantity(second, "size") > parse_quantity(first, "size") else first
