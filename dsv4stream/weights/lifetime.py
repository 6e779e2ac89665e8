"""Loud ends for weights whose bytes live in a slot that is refilled later.

A streamed layer's weights (the trunk ring) and a streamed expert's (the expert store) are
views into a slot. When the slot is about to receive other bytes, its provider calls
`expire` on the weights object it handed out: every field of that object, and of the
weights objects inside it, becomes an `Expired` stand-in, so code that kept the object and
touches it afterwards gets a LifetimeError naming what it held and why it ended, instead of
silently computing with another layer's bytes. Only the containers are changed: a
`QWeight` or an array taken out of the object before it expired is not caught (hold the
object, not its parts), and shared leaves (matrices placed in VRAM) stay intact.
"""

from __future__ import annotations

import dataclasses
import functools

from ..errors import LifetimeError
from ..kernels import QWeight


class Expired:
    """Stands in for a field of expired weights: any use raises LifetimeError(why)."""

    __slots__ = ("_why",)

    def __init__(self, why: str) -> None:
        object.__setattr__(self, "_why", why)

    def _fail(self, *args: object, **kwargs: object) -> None:
        raise LifetimeError(object.__getattribute__(self, "_why"))

    def __getattr__(self, name: str) -> object:
        self._fail()

    def __repr__(self) -> str:
        return f"Expired({object.__getattribute__(self, '_why')!r})"


# numpy, arithmetic, iteration, truth: every way a kernel or the math could touch a field
for _name in (
    "__array__", "__array_ufunc__", "__array_function__", "__getitem__", "__iter__", "__len__", "__bool__",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__matmul__", "__rmatmul__",
    "__truediv__", "__rtruediv__", "__neg__", "__float__", "__int__", "__index__", "__lt__", "__gt__",
    "__le__", "__ge__",
):  # fmt: skip
    setattr(Expired, _name, Expired._fail)


@functools.cache
def _fields(cls: type) -> tuple[str, ...] | None:
    """The field names `expire` replaces on an instance of cls; None for a class whose instances
    it leaves alone (not a dataclass, a QWeight, a class itself). Per class, once: a decode
    step expires about 24 experts' weights."""
    if not dataclasses.is_dataclass(cls) or issubclass(cls, (type, QWeight)):
        return None
    return tuple(f.name for f in dataclasses.fields(cls))


def expire(weights: object, why: str) -> None:
    """Replace every field of the weights dataclass `weights` (and of those nested in it,
    tuples included) with `Expired(why)`; QWeights and arrays themselves are left alone."""
    names = _fields(type(weights))
    if names is None:
        return
    for name in names:
        value = getattr(weights, name)
        if isinstance(value, Expired):
            continue
        for part in value if isinstance(value, tuple) else (value,):
            expire(part, why)
        object.__setattr__(weights, name, Expired(why))
