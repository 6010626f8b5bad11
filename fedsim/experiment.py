"""The composition root: a composed config becomes one :class:`Experiment`, every check done before any output.

Everything below it takes plain typed arguments. What crosses a process boundary (to workers, Ray actors or
SuperNodes) is the *client spec*: a JSON string of plain values from which ``fedsim.build.client_task``
rebuilds a client's data and model once per process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord
from omegaconf import DictConfig, OmegaConf

from fedsim import build, build_server
from fedsim.checks import number
from fedsim.clock import Heterogeneity
from fedsim.data.base import Dataset
from fedsim.errors import ConfigError
from fedsim.groups import EngineSettings, Placement, typed
from fedsim.messages import global_state
from fedsim.state import LoopConfig
from fedsim.strategies import base
from fedsim.tasks import CLASSIFICATION, Task
from fedsim.training import evaluate
from fedsim.validate import clients_per_round, validate

log = logging.getLogger("fedsim")


@dataclass
class Experiment:
    """Everything a run needs, built and checked: config, data, partitions, model, strategy, loop knobs."""

    cfg: DictConfig
    resolved: dict  # the config with interpolations resolved (checkpoints and summary.json keep it)
    spec_json: str  # the client spec sent in every train message
    placement: Placement
    engine: EngineSettings
    loop: LoopConfig
    dataset: Dataset
    client_shares: list[np.ndarray]  # the partitioner's output, one index array per client
    strategy: Any
    clock: Heterogeneity
    initial_model: torch.nn.Module
    evaluate_fn: Callable[[ArrayRecord], tuple[float, float]]  # (loss, the task's metric) on the test split
    task: Task = CLASSIFICATION  # the loss and metric (``task=`` group)
    callbacks: list = field(default_factory=list)  # the logger and the user's callbacks (fedsim.callbacks)


def build_experiment(cfg: DictConfig, deployed: bool = False) -> Experiment:
    """Build and check everything ``cfg`` names; raise ``ConfigError`` (one line) on the first bad value.

    ``deployed``: the clients are SuperNodes that resolve ``placement.device`` on their own machines.
    """
    validate(cfg)
    placement = typed("placement", Placement, OmegaConf.to_container(cfg.placement, resolve=True))
    engine = typed("engine", EngineSettings, OmegaConf.to_container(cfg.engine, resolve=True))
    torch.set_num_threads(placement.threads_per_client)
    build.set_numerics(placement.deterministic)
    spec_json = build.client_spec(cfg, device=placement.device)
    spec = json.loads(spec_json)
    build.local_training(spec)  # the client group and the faults group, checked before any work
    build.fault_rates(spec)
    task = build.build_task(spec)
    ds = build.build_dataset(spec)
    build.check_task(task, ds, ds.name)
    validate_targets(cfg, task)
    check_objective(cfg, task)
    build.build_splits(spec)  # partitions and checks val_fraction; clients are split when first sampled
    m = clients_per_round(cfg)
    strategy = build_server.build_strategy(cfg, m)
    build_server.bind_client_algorithm(
        spec, strategy
    )  # the strategy's client half, or a refusal naming the pair
    if build.client_algorithm(spec).stateful and base.is_async(strategy):
        raise ConfigError(
            "strategy",
            cfg.strategy.get("_target_"),
            "a synchronous strategy with a stateful client algorithm",
        )
    spec_json = json.dumps(spec, sort_keys=True)
    clock = build_server.build_heterogeneity(cfg, int(cfg.num_clients))
    model = build.build_initial_model(spec)
    check_model = getattr(base.unwrap(strategy), "check_model", None)
    if callable(check_model):  # e.g. FedPer's personal layers must name parts of this model
        try:
            check_model([n for n, _ in model.named_parameters()])
        except ConfigError as e:
            raise e.with_prefix("strategy") from None
    # deployed clients and Ray's actors resolve placement.device in their own processes
    remote = deployed or engine.name == "ray"
    local = build.local_training(spec)
    if not remote and "auto" in (placement.device, placement.server_device):
        placement = auto_placement(placement, model, ds, local, m, int(cfg.num_clients))
        spec["device"] = placement.device
        spec_json = json.dumps(spec, sort_keys=True)
    client_device = "cpu" if remote else build.resolve_device(placement.device)
    batched = not remote and engine.name in ("auto", "vectorized")
    fit = check_memory(
        model,
        m,
        ds.x_train.nbytes + ds.x_test.nbytes,
        client_device,
        batched=(local, ds.x_train[:1], float(cfg.strategy.get("proximal_mu") or 0.0)) if batched else None,
    )
    if batched and fit < (engine.max_cohort or m):
        log.info(
            "memory: %d clients per batched step on %s (split before the first round)", fit, client_device
        )
        engine = dataclasses.replace(engine, max_cohort=fit)
    server_device = build.resolve_device(placement.server_device, "placement.server_device")
    loop = LoopConfig(
        seed=int(cfg.seed),
        num_clients=int(cfg.num_clients),
        num_rounds=int(cfg.num_rounds),
        clients_per_round=m,
        min_replies=int(cfg.min_replies),
        round_timeout=float(cfg.round_timeout),
        node_timeout=float(cfg.get("node_timeout") or 300),
        eval_every=int(cfg.eval_every),
        federated_eval=bool(cfg.federated_eval),
        fraction_evaluate=float(cfg.strategy.get(build_server.LOOP_OWNED_STRATEGY_KEY, 1.0)),
        metric=task.metric,
    )
    return Experiment(
        cfg=cfg,
        resolved=OmegaConf.to_container(cfg, resolve=True),
        spec_json=spec_json,
        placement=placement,
        engine=engine,
        loop=loop,
        dataset=ds,
        client_shares=build.build_shares(spec),
        strategy=strategy,
        clock=clock,
        initial_model=model,
        evaluate_fn=make_evaluator(
            build.build_initial_model(spec), ds.x_test, ds.y_test, server_device, task
        ),
        task=task,
        callbacks=build_server.build_callbacks(cfg),
    )


def validate_targets(cfg: DictConfig, task: Task) -> None:
    """``target_<metric>`` keys: the task's own is a number (at most 1 for accuracy and R²); another task's
    target is refused, since its metric is never measured (e.g. ``target_accuracy`` under ``task=regression``)."""
    own = f"target_{task.metric}"
    for key in ("target_accuracy", "target_r2"):
        value = cfg.get(key)
        if value is None or key == own:
            continue
        raise ConfigError(
            key,
            value,
            f"null under task={task.name}, whose metric is {task.metric}",
            f"Set {own} instead" + ("." if own in cfg else f" (+{own}=... on the command line)."),
        )
    value = cfg.get(own)
    if task.metric in ("accuracy", "r2"):  # both at most 1; R² may be any lower value
        lo = 0.0 if task.metric == "accuracy" else -math.inf
        number(own, value, lo, 1.0, lo_open=True, allow_none=True)
    else:
        number(own, value, -math.inf, math.inf, allow_none=True)


# summary.json fields a sweeper may optimise besides the task's metric, and whether higher is better
OBJECTIVES = {
    "final_eval_loss": False,
    "final_train_loss": False,
    "rounds_done": True,
    "sim_time": False,
    "wall_time": False,
    "target_round": False,
    "target_sim_time": False,
    "target_wall_time": False,
    "final_epsilon": False,
    "total_failures": False,
}


def _task_of(cfg: DictConfig) -> Task:
    return build.build_task(
        {"task": OmegaConf.to_container(cfg.task, resolve=True) if cfg.get("task") else None}
    )


def objective_key(cfg: DictConfig) -> str:
    """The summary.json field a sweeper optimises: ``optimize_metric``, or the task's ``final_eval_<metric>``."""
    return cfg.get("optimize_metric") or f"final_eval_{_task_of(cfg).metric}"


def objective_higher_is_better(cfg: DictConfig) -> bool:
    """Whether a larger objective is a better run (accuracy, R²: yes; a loss, a time, epsilon: no)."""
    key, task = objective_key(cfg), _task_of(cfg)
    return OBJECTIVES.get(key, task.higher_is_better)


def check_objective(cfg: DictConfig, task: Task) -> None:
    """``optimize_metric`` names a numeric summary.json field (one line naming the allowed ones otherwise)."""
    key = cfg.get("optimize_metric")
    allowed = [*(f"{w}_eval_{task.metric}" for w in ("final", "best")), *OBJECTIVES]
    if key is not None and key not in allowed:
        raise ConfigError(
            "optimize_metric", key, f"null (the task's final metric) or one of {', '.join(allowed)}"
        )


def check_memory(
    model: torch.nn.Module, cohort: int, data_bytes: int, device: str, batched: tuple | None = None
) -> int:
    """Refuse a cohort whose memory estimate exceeds what the machine (or GPU) has free; return how many
    clients a batched step may hold (``cohort`` when all fit).

    Estimate: every sampled client's reply (one model copy each), a few global copies for aggregation and the
    data set; with ``batched = (local training, one example, proximal mu)`` (the vectorized engine), also the
    engine's own estimate of what each client of a batched step holds (weights, gradients, optimiser state,
    activations: ``fedsim.engines.vectorized.client_bytes``). A cohort whose batched step does not fit is split
    into steps of the clients that do (the return value); only one that cannot fit one client is refused.
    """
    model_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    need = model_bytes * (cohort + 4) + data_bytes
    per_client = 0
    if batched is not None:
        from fedsim.engines.vectorized import client_bytes

        local, example, mu = batched
        if local.batch_size and len(example):  # (full batch: the engine checks each cohort's width itself)
            per_client = client_bytes(model, torch.as_tensor(example)[0], local, local.batch_size, mu)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return cohort
    where = "RAM"
    if device.startswith("cuda") and torch.cuda.is_available():
        avail, _ = torch.cuda.mem_get_info(torch.device(device))
        where = "GPU memory"
    if need + per_client > avail:
        raise ConfigError(
            "clients_per_round",
            cohort,
            f"a cohort that fits: about {(need + per_client) / 2**30:.1f} GiB needed with one client per batched "
            f"step, {avail / 2**30:.1f} GiB {where} free",
            "Sample fewer clients per round or use a smaller model.",
        )
    if not per_client:
        return cohort
    return int(max(1, min(cohort, (0.8 * avail - need) // per_client)))


AUTO_GPU_FLOP = 2e9  # placement=auto: a round's client training above this many FLOP runs on the GPU


def training_flop(model: torch.nn.Module, example: torch.Tensor) -> float:
    """About the FLOP of one training example: 6 per multiply-add of the Linear and Conv layers (forward 2,
    backward 4), counted on one forward pass."""
    macs = 0

    def count(m, _inp, out):
        nonlocal macs
        if isinstance(m, torch.nn.Linear):
            macs += out.numel() * m.in_features
        else:
            macs += out.numel() * (m.in_channels // m.groups) * math.prod(m.kernel_size)

    kinds = (torch.nn.Linear, torch.nn.modules.conv._ConvNd)
    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, kinds)]
    try:
        with torch.no_grad():
            model(example.unsqueeze(0))
    finally:
        for h in hooks:
            h.remove()
    return 6.0 * macs


def auto_placement(
    placement: Placement, model: torch.nn.Module, ds: Dataset, local, cohort: int, num_clients: int
) -> Placement:
    """``placement.device`` / ``server_device`` ``auto``: the GPU when one is visible and a round's client
    training is big enough to gain from it (above :data:`AUTO_GPU_FLOP`), else the CPU; logged in the run's
    first lines. Measured: the default experiment (an MLP, 10 clients of ~65 examples, ~4e7 FLOP a round) took
    3.09 s on an H200 against 1.57 s on the same box's CPU; the CIFAR-size CNN with 100 clients (~1e11) is many
    times faster on the GPU."""
    if not torch.cuda.is_available():
        log.info("placement=auto: cpu (no GPU visible)")
        return dataclasses.replace(
            placement,
            device="cpu" if placement.device == "auto" else placement.device,
            server_device="cpu" if placement.server_device == "auto" else placement.server_device,
        )
    per_client = ds.x_train.shape[0] / max(num_clients, 1)
    if local.local_steps > 0:
        examples = local.local_steps * (local.batch_size or per_client)
    else:
        examples = local.local_epochs * per_client
    flop = training_flop(model, torch.as_tensor(ds.x_train[:1])[0]) * examples * cohort
    device = "cuda" if flop > AUTO_GPU_FLOP else "cpu"
    log.info(
        "placement=auto: %s (about %.1g FLOP of client training a round; the GPU above %.0g)",
        device,
        flop,
        AUTO_GPU_FLOP,
    )
    return dataclasses.replace(
        placement,
        device=device if placement.device == "auto" else placement.device,
        server_device=device if placement.server_device == "auto" else placement.server_device,
    )


def make_evaluator(
    model: torch.nn.Module, x: np.ndarray, y: np.ndarray, device: str, task: Task = CLASSIFICATION
):
    """Centralised evaluation of global arrays on the server's test split: ``(loss, the task's metric)``."""
    model = model.to(device)
    xt, yt = torch.as_tensor(x, device=device), torch.as_tensor(y, device=device)

    def evaluate_fn(arrays: ArrayRecord) -> tuple[float, float]:
        # parsed once per record: the next round's clients get the same record (local engines)
        model.load_state_dict(global_state(arrays))
        return evaluate(model, xt, yt, task=task)

    return evaluate_fn
