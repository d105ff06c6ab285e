"""Name-keyed registries filled by the ``miles_register_<kind>(register)`` hooks.

Each registry holds the specs of one kind (``Registry[GeneratorSpec]`` ...); each entry remembers
which plugin and distribution registered it, so errors can name both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from miles.errors import PluginError, closest_name

T = TypeVar("T")
S_contra = TypeVar("S_contra", contravariant=True)


class Register(Protocol[S_contra]):
    """``register(name, spec)``: what a ``miles_register_<kind>`` hook implementation receives.

    ``Register[GeneratorSpec]`` takes a :class:`~miles_contracts.GeneratorSpec`; the hook's
    docstring names the spec of its kind.
    """

    def __call__(self, name: str, spec: S_contra, /) -> None: ...


@dataclass(frozen=True, slots=True)
class Entry(Generic[T]):
    """One registered name: ``obj`` is the spec the plugin registered (adapted, for a bare object)."""

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
    """Specs of one kind (``advantage``, ``reward`` ...) by name.

    :param name_hint: for a name nobody registered, which package provides it and how to get it
        (``"it comes with miles-fsdp, which is not installed (pip install miles-fsdp)"``), or None.
    :param install: what to install when nothing of this kind is registered
        (``"pip install miles-fsdp or miles-megatron"``).
    """

    def __init__(self, kind: str, hook: str, *, name_hint: Callable[[str], str | None] | None = None,
                 install: str = "") -> None:
        self.kind = kind
        self.hook = hook
        self.name_hint = name_hint
        self.install = install or "install a package that registers one"
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
        """The spec registered as ``name`` (an error listing the registered names otherwise)."""
        return self.entry(name).obj

    def entry(self, name: str) -> Entry[T]:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(self.unknown_message(name)) from None

    def unknown_message(self, name: str) -> str:
        """Why ``name`` is not here: the package that provides it (and whether it is installed),
        else the registered names and the closest one."""
        hint = self.name_hint(name) if self.name_hint else None
        if hint:
            installed = f"; installed: {self.describe()}" if self._entries else f"; no {self.kind} is installed"
            return f"unknown {self.kind} {name!r}: {hint}{installed}"
        if not self._entries:
            return f"unknown {self.kind} {name!r}: no {self.kind} is installed; {self.install}"
        close = closest_name(name, self._entries)
        hint = f" Did you mean {close!r}?" if close else ""
        return f"unknown {self.kind} {name!r}; registered: {self.describe()}.{hint}"

    def describe(self) -> str:
        return ", ".join(f"{e.name} ({e.origin})" for e in self._entries.values())

    def names(self) -> list[str]:
        return list(self._entries)

    def entries(self) -> list[Entry[T]]:
        return list(self._entries.values())

    def specs(self) -> list[T]:
        return [e.obj for e in self._entries.values()]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
