"""The server's side of the composition root (:mod:`fedsim.experiment`): the strategy with its wrappers folded
around it, the client algorithm bound to it, the simulated clock and the callbacks.

A client never imports this module: what a client builds from its spec (data, model, client algorithm) is in
:mod:`fedsim.build`, whose instantiation helpers this module shares.
"""

from __future__ import annotations

import numpy as np
from omegaconf import DictConfig, ListConfig, OmegaConf

from fedsim import errors
from fedsim.build import (
    DEFAULT_CLIENT_ALGORITHM,
    _algorithm_class,
    _instantiate,
    client_algorithm,
    local_training,
    wrapper_sections,
)
from fedsim.errors import ConfigError


def build_callbacks(cfg: DictConfig) -> list:
    """The run's callbacks (``fedsim.callbacks``): the ``logger`` group's tracker, then ``callbacks``' own."""
    out = []
    logger = cfg.get("logger")
    if isinstance(logger, DictConfig) and logger.get("_target_"):
        out.append(_instantiate("logger", logger))
    nodes = cfg.get("callbacks")
    nodes = [] if nodes is None else nodes
    if not isinstance(nodes, (ListConfig, list)):
        raise ConfigError("callbacks", nodes, "a list of {_target_: module.Class, ...} mappings")
    for i, node in enumerate(nodes):
        if not isinstance(node, DictConfig) or not node.get("_target_"):
            raise ConfigError(f"callbacks[{i}]", node, "a mapping with a _target_ (module.Class)")
        out.append(_instantiate(f"callbacks[{i}]", node))
    return out


def bind_client_algorithm(spec: dict, strategy) -> None:
    """Give the strategy's clients the algorithm it needs, and refuse a pairing that cannot work.

    A strategy names its client half (``client_algorithm``, e.g. SCAFFOLD's); a client algorithm may name the
    strategy it needs (``strategy``). ``spec["client"]["_target_"]`` is set when the run did not choose one.
    """
    from hydra.utils import get_object

    from fedsim.strategies import base, composition

    need = base.client_algorithm(strategy)
    chosen = spec["client"].get("_target_")
    if need is not None:
        if chosen is None or chosen == DEFAULT_CLIENT_ALGORITHM:
            spec["client"]["_target_"] = need
        elif not issubclass(_algorithm_class(chosen), _algorithm_class(need)):
            raise ConfigError(
                "client._target_",
                chosen,
                f"{need} (or a subclass): {type(strategy).__name__} needs its client half",
            )
    cls = _algorithm_class(spec["client"].get("_target_") or DEFAULT_CLIENT_ALGORITHM)
    server = getattr(cls, "strategy", None)
    if server is not None and not isinstance(base.unwrap(strategy), get_object(server)):
        raise ConfigError(
            "client._target_",
            spec["client"].get("_target_"),
            f"a client algorithm for {type(base.unwrap(strategy)).__name__}: {cls.__name__} needs strategy "
            f"{server.rsplit('.', 1)[-1]}",
        )
    client_algorithm(spec)  # its own parameters, checked before any work
    # from what each side declares it releases: e.g. DP does not cover SCAFFOLD's control variates
    composition.check(strategy, cls, local_training(spec).optimizer)


# A key of the strategy's YAML that the loop owns: the share of a round's cohort asked to evaluate.
LOOP_OWNED_STRATEGY_KEY = "fraction_evaluate"


def build_strategy(cfg: DictConfig, clients_per_round: int):
    """The server strategy from ``strategy=``, with the wrappers the config names folded around it
    (:func:`wrapper_sections`: ``clipping=``, ``compression=``, ``attack=``, ``selection=``, a user's own).

    fedsim samples the cohort (and, with ``federated_eval``, the evaluators: ``strategy.fraction_evaluate`` of
    it, read by the loop alone) and hands the strategy a view holding only the sampled nodes, so the strategy
    is built to send to every node it is given.
    """
    from fedsim.strategies import base, composition

    node = OmegaConf.to_container(cfg.strategy, resolve=True)
    node.pop(LOOP_OWNED_STRATEGY_KEY, None)
    strategy = _instantiate(
        "strategy",
        OmegaConf.create(node),
        fraction_train=1.0,
        min_train_nodes=1,
        min_available_nodes=1,
        fraction_evaluate=1.0 if cfg.get("federated_eval") else 0.0,
        min_evaluate_nodes=1,
    )
    check_user_combine(strategy)
    if base.is_async(strategy):
        _check_async(cfg, strategy)
    else:
        try:
            base.check_cohort(strategy, clients_per_round)
        except ConfigError as e:  # a strategy knob, or the run's own clients_per_round
            raise (e if e.key == "clients_per_round" else e.with_prefix("strategy")) from None
    run_values = {
        "num_clients": int(cfg.num_clients),
        "clients_per_round": clients_per_round,
        "seed": int(cfg.seed),
    }
    for section, cls in wrapper_sections(cfg):  # innermost first: e.g. clipping sees the attack's updates
        if base.is_async(strategy):
            why, expected = cls.async_refusal(section, cfg[section], strategy)
            raise composition.CompositionError(section, why, expected)
        extra = {k: v for k, v in run_values.items() if _takes(cls, k)}
        strategy = _instantiate(section, cfg[section], strategy=strategy, **extra)
    return strategy


def check_user_combine(strategy) -> None:
    """Check every model a user's ``combine`` (a strategy class outside fedsim) returns against the models it
    combined: the same keys and shapes, floating point where they are. A wrong one would otherwise fail later in
    torch's ``load_state_dict`` without naming the user's code, or, with integers, be cast back silently and train
    nothing. The refusal names the user's file and the key."""
    import inspect

    cls = type(strategy)
    owner = next((c for c in cls.__mro__ if "combine" in vars(c)), None)
    if owner is None or owner.__module__.split(".")[0] == "fedsim":
        return
    inner = strategy.combine
    try:
        where = f"{inspect.getsourcefile(owner)}:{inspect.getsourcelines(vars(owner)['combine'])[1]}"
    except (OSError, TypeError):
        where = owner.__module__
    name = f"{where}: {owner.__qualname__}.combine"

    def combine(models, weights):
        out = inner(models, weights)
        like = models[0]
        if not hasattr(out, "keys") or set(out.keys()) != set(like.keys()):
            got = sorted(out.keys())[:5] if hasattr(out, "keys") else type(out).__name__
            raise errors.RunError(
                f"{name} returned {got}, not a model with the keys {sorted(like.keys())[:5]}"
            )
        for k, want in like.items():
            a, want = np.asarray(out[k]), np.asarray(want)
            if a.shape != want.shape:
                raise errors.RunError(
                    f"{name} returned {k!r} of shape {a.shape}; the model's is {want.shape}"
                )
            if np.issubdtype(want.dtype, np.floating) and not np.issubdtype(a.dtype, np.floating):
                raise errors.RunError(
                    f"{name} returned {k!r} as {a.dtype}; the model's weights are floating point ({want.dtype})"
                )
        return out

    strategy.combine = combine


def _check_async(cfg: DictConfig, strategy) -> None:
    """An asynchronous strategy: the population must hold its concurrency; no sync-only features."""
    try:
        strategy.check_population(int(cfg.num_clients))
    except ConfigError as e:
        raise e.with_prefix("strategy") from None
    if cfg.get("federated_eval"):
        raise ConfigError("federated_eval", True, "false with an asynchronous strategy")


def _takes(cls: type, name: str) -> bool:
    """Whether ``cls(...)`` accepts the keyword ``name`` (by name, or through ``**kwargs``)."""
    import inspect

    params = inspect.signature(cls).parameters
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def build_heterogeneity(cfg: DictConfig, num_clients: int):
    """The simulated-time model from ``heterogeneity=``."""
    return _instantiate("heterogeneity", cfg.heterogeneity, num_clients=num_clients, seed=int(cfg.seed))
