"""What each strategy, client algorithm and update wrapper releases, and which combinations DP covers.

Every component declares in code (class attributes) what it releases to the clients and how that is computed
from the clients' replies; a wrapper declares which kinds of release it privatises. The refusals below are
derived from those declarations alone, never from a list of strategy names, so a new strategy is classified
the moment it declares what it releases.

Declarations
------------
``Strategy.releases`` : tuple of :class:`Release`
    What the server sends to every client each round beyond public settings (the global model, control
    variates, ...), each with the :data:`KINDS` entry saying how it depends on the replies. Undeclared:
    ``(Release("its global model", MEAN),)``, Flower's FedAvg and every mean-type rule.
``Strategy.needs_local`` : str or None
    The local optimiser the strategy's server rule assumes (FedNova's normaliser ``a_i = tau_i`` is plain
    SGD's); other optimisers are refused.
``ClientAlgorithm.sends`` : tuple of :class:`Release`
    Arrays a client algorithm sends back besides its model (SCAFFOLD's ``dc_i``).
``ClientAlgorithm.keeps`` : str or None
    Per-client state that never leaves the client (Ditto's personal model).
``wrapper.privatises`` : frozenset of kinds
    What a DP wrapper clips and noises with an analysed sensitivity (``ClippingWrapper``: a mean).
``wrapper.draws_cohort`` : str
    The wrapper draws the round's cohort itself (DP's Poisson sampler, power of choice): two such wrappers
    do not compose.

DP mode is ``clipping.noise_multiplier > 0``. A release is **covered** when its kind is in the DP wrapper's
``privatises`` (its noise is calibrated to one client's influence, ``C / m``), **kept** when it never leaves
the client, and otherwise the run is **refused** before any work with one line naming both components and
why (:func:`check`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

import yaml

from fedsim.errors import ConfigError

# How a release depends on the clients' replies (the declared kinds), and why DP does not cover the others.
MEAN = "mean"
ROBUST = "robust"
WEIGHTED = "weighted"
COHORT_SCALED = "cohort-scaled"
RAW = "raw"
SEQUENTIAL = "sequential"
NORMALISED = "normalised"
KINDS = {
    MEAN: "a fixed-denominator mean of the clipped updates (a server optimiser on it is post-processing)",
    ROBUST: "is a robust rule whose sensitivity to one client is not the C/m the noise is calibrated to",
    WEIGHTED: "weights each clipped update by a factor the clients report, so one client can move it by more "
    "than the C/m the noise is calibrated to",
    COHORT_SCALED: "scales with the number of replies, so one client can move it by more than the C/m the noise "
    "is calibrated to",
    RAW: "is released without noise, computed from the clients' exact, unclipped values",
    SEQUENTIAL: "applies each client's update on its own; clipping and DP wrap synchronous aggregation",
    NORMALISED: "is tau_eff times the mean of each update divided by its client's step count tau_i; DP clips "
    "those normalised updates and needs a public tau_eff (strategy.dp_tau_eff), as sum p_i tau_i depends on the "
    "clients' data",
}

SHORT = {  # the README table's words for each kind
    MEAN: "covered",
    ROBUST: "refused: robust rule, sensitivity not analysed",
    WEIGHTED: "refused: client-reported weights exceed C/m",
    COHORT_SCALED: "refused: scales with the cohort size",
    RAW: "refused: released without noise",
    SEQUENTIAL: "refused: asynchronous",
    NORMALISED: "privatised: update / tau_i clipped, public `strategy.dp_tau_eff` (refused without)",
}


@dataclass(frozen=True)
class Release:
    """One thing a component releases: ``what`` (as the refusal names it) and its kind (a :data:`KINDS` key)."""

    what: str
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Release kind must be one of {sorted(KINDS)}, got {self.kind!r}")


GLOBAL_MEAN = (Release("its global model", MEAN),)


class CompositionError(ConfigError):
    """Two components that do not compose: one line naming both, why, and what is expected instead."""

    def __init__(self, key: str, message: str, expected: str) -> None:
        ValueError.__init__(self, f"{message} (expected {expected})")
        self.key, self.value, self.allowed, self.hint = key, None, expected, ""

    def with_prefix(self, prefix: str) -> ConfigError:
        return self


def name_of(component: object) -> str:
    """A component's config option name: ``strategy=scaffold`` names ``Scaffold`` (its class name, lower case)."""
    cls = component if isinstance(component, type) else type(component)
    return str(getattr(cls, "option_name", cls.__name__.lower()))


def releases(strategy: object) -> tuple[Release, ...]:
    """What ``strategy`` (a class or an instance, not a wrapper) declares it releases to the clients."""
    from fedsim.strategies.async_base import AsyncStrategy

    cls = strategy if isinstance(strategy, type) else type(strategy)
    if issubclass(cls, AsyncStrategy):
        return tuple(getattr(cls, "releases", (Release("its global model", SEQUENTIAL),)))
    return tuple(getattr(cls, "releases", GLOBAL_MEAN))


def chain(strategy: object) -> list[object]:
    """The wrappers around a strategy, outermost first, then the strategy itself."""
    from flwr.serverapp.strategy import Strategy

    from fedsim.strategies.async_base import AsyncStrategy

    out = [strategy]
    while isinstance(getattr(out[-1], "strategy", None), (Strategy, AsyncStrategy)):
        out.append(out[-1].strategy)
    return out


def dp_refusal(strategy: object, privatises: frozenset[str], dp: bool = True) -> str | None:
    """Why a wrapper that privatises ``privatises`` does not cover ``strategy`` (None: it does).

    ``dp=False`` (clipping only) refuses only what no clipping wrapper can wrap.
    """
    mode = "DP" if dp else "clipping"
    for release in releases(strategy):
        if release.kind == SEQUENTIAL or (dp and release.kind not in privatises):
            return f"{mode} does not cover strategy={name_of(strategy)}: {release.what} {KINDS[release.kind]}"
        # a normalised release is privatised only with a public tau_eff (an instance setting; a class has none)
        if dp and release.kind == NORMALISED and getattr(strategy, "dp_tau_eff", None) is None:
            return (
                f"DP does not cover strategy={name_of(strategy)} without strategy.dp_tau_eff: {release.what} "
                f"{KINDS[release.kind]}"
            )
    return None


def sends(algorithm: type) -> tuple[Release, ...]:
    """What a client algorithm declares it sends besides its model (``sends``: ``(what, kind)`` pairs)."""
    return tuple(r if isinstance(r, Release) else Release(*r) for r in getattr(algorithm, "sends", ()))


def algorithm_refusal(algorithm: type, privatises: frozenset[str]) -> str | None:
    """Why DP does not cover a client algorithm (None: what it sends is privatised or nothing leaves it)."""
    for release in sends(algorithm):
        if release.kind not in privatises:
            return (
                f"DP does not cover client._target_={algorithm.__module__}.{algorithm.__name__}: "
                f"{release.what} {KINDS[release.kind]}"
            )
    return None


def local_refusal(strategy: object, optimizer: str) -> str | None:
    """Why ``strategy``'s server rule does not fit clients training with ``optimizer`` (None: it does)."""
    need = getattr(strategy, "needs_local", None)
    if need is None or optimizer == need:
        return None
    return (
        f"strategy={name_of(strategy)} does not cover client.optimizer={optimizer}: its server rule assumes "
        f"{getattr(strategy, 'needs_local_why', 'plain ' + need + ' local steps')}"
    )


def check(strategy: object, algorithm: type | None = None, optimizer: str | None = None) -> None:
    """Refuse (``CompositionError``, one line) a wrapped strategy, client algorithm and local optimiser that do
    not compose, from their declarations; return quietly when they do."""
    parts = chain(strategy)
    inner = parts[-1]
    drawers = [w for w in parts[:-1] if getattr(w, "draws_cohort", None)]
    if len(drawers) > 1:
        outer, other = drawers[0], drawers[1]
        raise CompositionError(
            "selection",
            f"selection={name_of(outer)} does not compose with clipping={name_of(other)}: both draw the cohort "
            f"(clipping draws {other.draws_cohort}; selection draws {outer.draws_cohort})",
            f"selection=uniform with clipping={name_of(other)}",
        )
    for wrapper in parts[:-1]:
        privatises = getattr(wrapper, "privatises", None)
        if privatises is None:
            continue
        dp = bool(getattr(wrapper, "dp", False))
        why = dp_refusal(inner, frozenset(privatises), dp)
        if why is None and dp and algorithm is not None:
            why = algorithm_refusal(algorithm, frozenset(privatises))
        if why is not None:
            raise CompositionError("clipping", why, refusal_fix(why))
    if optimizer is not None:
        why = local_refusal(inner, optimizer)
        if why is not None:
            raise CompositionError("client.optimizer", why, f"client.optimizer={inner.needs_local}")


def refusal_fix(why: str) -> str:
    """What to type instead of a refused combination."""
    if why.startswith("clipping ") or KINDS[SEQUENTIAL] in why:
        return "clipping=none with an asynchronous strategy"
    if KINDS[NORMALISED] in why:
        return "strategy.dp_tau_eff set to a public number of local steps, e.g. client.local_steps"
    return "clipping.noise_multiplier=0, or a strategy and client algorithm that DP covers (README, Privacy)"


# ---------------------------------------------------------------- the README's privacy table, from the code
def _conf_dir() -> Path:
    import fedsim.conf

    return Path(fedsim.conf.__file__).parent


def option_of(group: str, cls: type) -> str:
    """The option of fedsim's config ``group`` whose ``_target_`` is ``cls`` (``attack=label_flip``), else
    :func:`name_of` (a user's own class)."""
    target = f"{cls.__module__}.{cls.__qualname__}"
    folder = _conf_dir() / group
    for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
        node = yaml.safe_load(path.read_text()) or {}
        if isinstance(node, dict) and node.get("_target_") == target:
            return path.stem
    return name_of(cls)


def off_option(group: str) -> str:
    """The option of fedsim's config ``group`` that turns it off (no ``_target_``), e.g. ``attack=none``;
    ``none`` for a group fedsim does not ship."""
    folder = _conf_dir() / group
    for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
        node = yaml.safe_load(path.read_text()) or {}
        if isinstance(node, dict) and not node.get("_target_"):
            return path.stem
    return "none"


def shipped_strategies() -> dict[str, type]:
    """Every strategy ``conf/strategy/*.yaml`` names: option name -> class."""
    out = {}
    for path in sorted((_conf_dir() / "strategy").glob("*.yaml")):
        target = yaml.safe_load(path.read_text())["_target_"]
        module, cls = target.rsplit(".", 1)
        out[path.stem] = getattr(importlib.import_module(module), cls)
    return out


def shipped_algorithms() -> dict[str, type]:
    """The default client algorithm and every one a shipped strategy names: class path -> class."""
    from fedsim.algorithms.base import LocalSGD

    out: dict[str, type] = {"fedsim.algorithms.base.LocalSGD": LocalSGD}
    for cls in shipped_strategies().values():
        path = getattr(cls, "client_algorithm", None)
        if path:
            module, name = path.rsplit(".", 1)
            out[path] = getattr(importlib.import_module(module), name)
    return out
