"""Name-keyed registries filled by the ``miles_register_<kind>(register)`` hooks.

Each entry remembers which plugin and distribution registered it, so errors can name both.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from miles.errors import PluginError

T = TypeVar("T")

Register = Callable[[str, Any], None]
"""``register(name, obj)``: what a ``miles_register_<kind>`` hook implementation receives."""


@dataclass(frozen=True, slots=True)
class Entry(Generic[T]):
    name: str
    obj: T
    plugin: str
    distribution: str | None
    version: str | None

    @property
    def origin(self) -> str:
        if self.distribution:
            return f"{self.distribution} {self.version}" if self.version else self.distribution
        return f"plugin {self.plugin}"


class UnknownNameError(PluginError, LookupError):
    """Config named an implementation that no loaded plugin registered."""


class Registry(Generic[T]):
    """Implementations of one kind (``advantage``, ``reward`` ...) by name."""

    def __init__(self, kind: str, hook: str) -> None:
        self.kind = kind
        self.hook = hook
        self._entries: dict[str, Entry[T]] = {}

    def add(self, entry: Entry[T]) -> None:
        if not entry.name or not isinstance(entry.name, str):
            raise PluginError(f"plugin {entry.plugin!r} ({entry.origin}) registered a {self.kind} with an invalid name {entry.name!r}")
        previous = self._entries.get(entry.name)
        if previous is not None:
            raise PluginError(
                f"{self.kind} {entry.name!r} is registered twice: by plugin {previous.plugin!r} ({previous.origin}) "
                f"and by plugin {entry.plugin!r} ({entry.origin}); disable one of them with plugins.disable "
                f"or MILES_DISABLE_PLUGINS={entry.plugin}"
            )
        self._entries[entry.name] = entry

    def get(self, name: str) -> T:
        return self.entry(name).obj

    def entry(self, name: str) -> Entry[T]:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(self.unknown_message(name)) from None

    def unknown_message(self, name: str) -> str:
        if not self._entries:
            return (
                f"unknown {self.kind} {name!r}: no {self.kind} is registered "
                f"(no loaded plugin implements {self.hook}); install a package that provides one"
            )
        close = difflib.get_close_matches(name, list(self._entries), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return f"unknown {self.kind} {name!r}; registered: {self.describe()}.{hint}"

    def describe(self) -> str:
        return ", ".join(f"{e.name} ({e.origin})" for e in self._entries.values())

    def names(self) -> list[str]:
        return list(self._entries)

    def entries(self) -> list[Entry[T]]:
        return list(self._entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
