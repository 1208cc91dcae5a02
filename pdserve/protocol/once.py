"""``once``: a property worked out at its first read and kept with its instance.

``functools.cached_property`` does this, but on Python 3.11 it takes an RLock on every
first read (~1% of the router's CPU on the P/D path for a snapshot's pools, built for
nearly every request). ``once`` keeps the value in the instance's ``__dict__``, where
later reads find it before the descriptor, frozen dataclasses included. Meant for
immutable instances: two threads reading a value first at once both work out the same
one. Used for a snapshot's pools (router/scheduling/snapshot.py) and the codec form kept
by the sampling parameters and a KV handle (``wire``, read by pdserve/protocol/codec.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class once(Generic[T]):  # a decorator, named like property
    def __init__(self, fn: Callable[[Any], T]) -> None:
        self.fn = fn
        self.name = fn.__name__

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> once[T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> T | once[T]:
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)
        return value
