"""Registry: one per family (models, datasets, optimizers, ...), keyed by the name a user writes."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torchsprint.errors import UsageError, did_you_mean


class Registry:
    """A name -> builder map with lazily added name providers and "did you mean" errors.

    `providers` let a family expose names it does not own (every torchvision model, timm
    models when timm imports) without importing those libraries until a name is asked for.
    """

    def __init__(self, family: str, listed: str | None = None):
        """`family`: the singular a message names ("unknown model 'x'"); `listed`: the `torchsprint list` family that
        prints its names (commands/args.py FAMILIES), or None: an unknown name's message then names them all."""
        self.family, self.listed = family, listed
        self._items: dict[str, Callable[..., Any]] = {}
        self._providers: list[Callable[[], dict[str, Callable[..., Any]]]] = []  # not yet loaded, in order

    def register(self, name: str | None = None, *, override: bool = False):
        """Decorator: `@MODELS.register("my_net")` (defaults to the function's name)."""

        def deco(fn):
            key = name or fn.__name__
            if key in self._items and not override and self._items[key] is not fn:
                raise ValueError(f"{self.family} '{key}' is registered twice; pass override=True to replace it")
            self._items[key] = fn
            return fn

        return deco

    def add_provider(self, provider: Callable[[], dict[str, Callable[..., Any]]]) -> None:
        """Add a function returning extra {name: builder}; called once, when a lookup first needs it."""
        self._providers.append(provider)

    def _load(self, until: str | None = None) -> None:
        """Load providers in order, stopping once `until` is known (a torchvision name never imports timm)."""
        while self._providers and (until is None or until not in self._items):
            for key, fn in self._providers.pop(0)().items():
                self._items.setdefault(key, fn)  # project-registered names win

    def get(self, name: str) -> Callable[..., Any]:
        """The builder registered as `name`; a UsageError naming the closest names otherwise."""
        if name in self._items:
            return self._items[name]
        self._load(until=name)  # loads every provider when the name is nowhere
        if name in self._items:
            return self._items[name]
        where = (
            f"Run `torchsprint list {self.listed}` to see all {len(self._items)} names."
            if self.listed
            else f"Known: {', '.join(sorted(self._items))}."
        )
        raise UsageError(f"unknown {self.family} '{name}'.{did_you_mean(name, self._items)} {where}")

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        self._load()
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        self._load(until=name)
        return name in self._items

    def __iter__(self) -> Iterable[str]:
        return iter(self.names())
