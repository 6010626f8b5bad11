"""Instantiation helpers of the composition root (:mod:`fedsim.experiment`): with :mod:`fedsim.build_server`
(the strategy, its wrappers, the clock, the callbacks), the only modules that turn config into objects
(``hydra.utils.instantiate``). This one builds what a client needs: the client spec and, from it, the data,
the model and the client algorithm.

Everything below it takes plain typed arguments. What crosses a process boundary (to Ray actors or to
SuperNodes) is the *client spec*: a JSON string of plain values, from which ``client_task`` rebuilds the
client's data and model once per worker process and caches them.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from fedsim import errors
from fedsim.data.base import Dataset
from fedsim.errors import ConfigError
from fedsim.features.clipping.client import ClientClipping
from fedsim.features.faults.client import FaultRates, InjectedFaults
from fedsim.groups import typed
from fedsim.models import build_model
from fedsim.seeds import Purpose
from fedsim.seeds import rng as seeded_rng
from fedsim.training import LocalTraining

# Config sections a client needs to rebuild its task; they travel as JSON in every train message.
CLIENT_SPEC_KEYS = (
    "seed",
    "num_clients",
    "val_fraction",
    "dataset",
    "partitioner",
    "model",
    "client",
    "faults",
    "task",
)


def _parameters(target: str) -> list[str]:
    """The keyword parameters a ``_target_`` accepts (empty when it cannot be inspected)."""
    import inspect

    from hydra.utils import get_object

    try:
        sig = inspect.signature(get_object(target))
    except Exception:  # noqa: BLE001  (only for the error message)
        return []
    return [
        n
        for n, p in sig.parameters.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in ("self", "strategy")
    ]


def _instantiate(section: str, node: Any, **kwargs: Any) -> Any:
    """``instantiate`` that turns a ConfigError raised inside a target into one naming the config key.

    A key the target does not take (``TypeError: ... unexpected keyword argument 'k'``) becomes a ConfigError on
    ``section.k`` listing the parameters it does take.
    """
    if isinstance(node, DictConfig) and "_target_" not in node:  # a user's option file without one
        raise ConfigError(
            f"{section}._target_",
            None,
            "an importable class or function (module.name)",
            f"The YAML file of {_option(section)} has no _target_ line.",
        )
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        while cause is not None and not isinstance(cause, ConfigError):
            if isinstance(cause, TypeError) and (
                m := re.search(r"unexpected keyword argument '(\w+)'", str(cause))
            ):
                target = str(node.get("_target_", "")) if hasattr(node, "get") else ""
                params = [p for p in _parameters(target) if p not in kwargs]
                raise ConfigError(
                    f"{section}.{m.group(1)}",
                    node.get(m.group(1)) if hasattr(node, "get") else None,
                    f"a parameter of {target.rsplit('.', 1)[-1] or section}: {', '.join(params)}"
                    if params
                    else f"a parameter of {section}",
                ) from None
            cause = cause.__cause__
        if isinstance(cause, ConfigError):
            raise cause.with_prefix(section) from None
        if str(e).startswith("Error locating target"):
            target = node.get("_target_") if hasattr(node, "get") else None
            hint = "Is its module on PYTHONPATH (e.g. PYTHONPATH=. for your own folder)?"
            original = errors.cause_chain(e)[-1]  # a module of the user's that fails to import: its own error
            absent = isinstance(original, ModuleNotFoundError) and f"{target}.".startswith(
                f"{original.name}."
            )
            if not absent and not isinstance(original, AttributeError):
                hint = f"Importing it failed: {errors.where_it_failed(e)}"
            raise ConfigError(
                f"{section}._target_", target, "an importable class or function (module.name)", hint
            ) from None
        raise
    except ConfigError as e:
        raise e.with_prefix(section) from None


# Client halves in every run's chain, before those the features name: a Flower strategy that is not fedsim's
# may ask for client-side clipping, and faults come from the run's own ``faults`` section.
ALWAYS_HALVES = (ClientClipping, InjectedFaults)


def class_path(cls: type | str) -> str:
    """A class's path (``module.Class``) as a run spec names it; a path given as a string stays as it is."""
    return cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"


def client_spec(cfg: DictConfig, device: str) -> str:
    """The JSON client spec for a composed run config."""
    spec = {
        k: OmegaConf.to_container(cfg[k], resolve=True) if isinstance(cfg[k], DictConfig) else cfg[k]
        for k in CLIENT_SPEC_KEYS
        if k in cfg
    }
    named = [cls.client_half for _, cls in wrapper_sections(cfg) if cls.client_half]
    spec["halves"] = [class_path(h) for h in (*ALWAYS_HALVES, *named)]  # the ClientChain's, in order
    spec["device"] = device
    spec["threads"] = int(cfg.placement.threads_per_client)
    spec["deterministic"] = bool(cfg.placement.get("deterministic", False))
    return json.dumps(spec, sort_keys=True)


def set_numerics(deterministic: bool) -> None:
    """``placement.deterministic``: reproducible GPU numerics, or torch's fast defaults.

    True: cuDNN picks deterministic algorithms (no autotuning), torch refuses (warns about) nondeterministic
    kernels, and TF32 is off for matmuls and convolutions, so a GPU computes in full fp32 like the CPU. False:
    torch's defaults (cuDNN may autotune and may use TF32 for convolutions). No effect on CPU results.
    """
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = not deterministic
    torch.backends.cuda.matmul.allow_tf32 = False
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS reductions
    # (the switch imports torch._inductor, a second per process: only called when it changes something)
    if deterministic or torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(deterministic, warn_only=True)


def agreement_tolerance(device: str, deterministic: bool, steps: int) -> float:
    """Relative tolerance within which two engines' models agree after ``steps`` local steps.

    Both run the same steps but may sum in another order (a batched convolution is a grouped one): each step's
    rounding is about ``eps`` times the length of the longest reduction (up to ~10^3 terms for a small CNN's
    weight gradient), and it adds up over the steps. On a GPU without ``deterministic``, convolutions may run
    in TF32 (10-bit mantissa, eps 2^-10), so there the bound is loose by design.
    """
    eps = torch.finfo(torch.float32).eps
    if torch.device(device).type == "cuda" and not deterministic:
        eps = 2.0**-10
    return float(min(1e-1, 1000 * eps * max(steps, 1)))


# Set by a local engine in each of its worker processes: 0, 1, ... (unset in the server's own process).
WORKER_INDEX_ENV = "FEDSIM_WORKER_INDEX"


def resolve_device(name: str, key: str = "placement.device", partition_id: int | None = None) -> str:
    """The torch device for ``name`` as seen by *this* process; check that a ``cuda:N`` device exists here.

    ``name`` is one the placement group accepted (``cpu``, ``auto``, ``cuda`` or ``cuda:N``). ``auto`` and
    ``cuda`` take a visible GPU: in worker ``k`` of a local pool (``FEDSIM_WORKER_INDEX=k``) GPU
    ``k mod count``, so the workers spread over every GPU of the box; for a client trained in the server's own
    process (``inprocess`` with one worker, ``vectorized``) GPU ``partition_id mod count``, so a cohort spreads
    over the GPUs too; elsewhere (the server's evaluation, a Ray actor, which sees only the GPU Ray gave it) the
    current one. ``auto`` without a visible GPU is ``cpu``.

    Raises
    ------
    ConfigError
        Naming ``key`` when ``name`` asks for a CUDA device this process does not see.
    """
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name in ("auto", "cuda") and count:
        worker = os.environ.get(WORKER_INDEX_ENV)
        if count > 1 and worker is not None:
            return f"cuda:{int(worker) % count}"
        if count > 1 and partition_id is not None:
            return f"cuda:{int(partition_id) % count}"
        return "cuda"
    if name == "auto":
        return "cpu"
    if name.startswith("cuda") and int(name.partition(":")[2] or 0) >= count:
        have = f"{count} CUDA device(s)" if count else "no CUDA device (or a CPU-only torch build)"
        raise ConfigError(
            key,
            name,
            f"a device this machine has: it has {have}",
            "Use placement=cpu, or placement.device=auto to take a GPU when there is one.",
        )
    return name


def _option(section: str) -> str:
    """``section=OPTION`` as chosen on the command line or in a config (``the section`` outside a Hydra run)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        choice = HydraConfig.get().runtime.choices.get(section) if HydraConfig.initialized() else None
    except Exception:  # noqa: BLE001  (only a better name for the option)
        choice = None
    return f"the option {section}={choice}" if choice else f"the {section} section"


@functools.lru_cache(maxsize=4)
def _dataset(dataset_json: str, seed: int) -> Dataset:
    node = OmegaConf.create(json.loads(dataset_json))
    ds = _instantiate("dataset", node, seed=seed)
    if not isinstance(ds, Dataset):  # a user's loader that forgot its return, or returned arrays
        raise ConfigError(
            "dataset._target_",
            node.get("_target_"),
            "a function returning fedsim.data.base.Dataset",
            f"It returned {type(ds).__name__}{'' if ds is None else ' ' + repr(ds)[:60]}.",
        )
    return ds


def build_dataset(spec: dict) -> Dataset:
    """Build (once per process) the data set named in a spec."""
    return _dataset(json.dumps(spec["dataset"], sort_keys=True), int(spec["seed"]))


@functools.lru_cache(maxsize=4)
def _shares(spec_key: str) -> list[np.ndarray]:
    spec = json.loads(spec_key)
    ds = build_dataset(spec)
    fn = _instantiate("partitioner", OmegaConf.create(spec["partitioner"]))
    rng = seeded_rng(int(spec["seed"]), Purpose.PARTITION)
    try:
        return fn(ds.partition_labels(), int(spec["num_clients"]), rng, groups=ds.groups)
    except ConfigError as e:
        raise (e if e.key == "num_clients" else e.with_prefix("partitioner")) from None
    except TypeError as e:  # a partial (`_partial_: true`) gets its keys only when called
        m = re.search(r"unexpected keyword argument '(\w+)'", str(e))
        if not m:
            raise
        target = str(spec["partitioner"].get("_target_", ""))
        params = [p for p in _parameters(target) if p not in ("labels", "num_clients", "rng", "groups")]
        raise ConfigError(
            f"partitioner.{m.group(1)}",
            spec["partitioner"].get(m.group(1)),
            f"a parameter of {target.rsplit('.', 1)[-1]}: {', '.join(params)}",
        ) from None


@functools.lru_cache(maxsize=4)
def _splits(spec_key: str):
    from fedsim.data.partition import ClientSplits

    spec = json.loads(spec_key)
    seed = int(spec["seed"])
    return ClientSplits(
        _shares(_partition_key(spec, split=False)),
        float(spec["val_fraction"]),
        lambda pid: seeded_rng(seed, Purpose.TRAIN_VAL_SPLIT, pid),
    )


def _partition_key(spec: dict, split: bool = True) -> str:
    keys = ("seed", "num_clients", "dataset", "partitioner") + (("val_fraction",) if split else ())
    return json.dumps({k: spec[k] for k in keys}, sort_keys=True)


def build_shares(spec: dict) -> list[np.ndarray]:
    """Every client's share of the training set (the partitioner's output), built once per process."""
    return _shares(_partition_key(spec, split=False))


def build_splits(spec: dict):
    """Every client's (train, val) split (:class:`~fedsim.data.partition.ClientSplits`), once per process.

    Clients are split when first used; ``build_splits(spec).sizes()`` are the training sizes of all.
    """
    return _splits(_partition_key(spec))


def build_partitions(spec: dict) -> tuple:
    """Per-client (train, val) index arrays for a spec: two read-only lists, each client split on access."""
    splits = build_splits(spec)
    return splits.train, splits.val


@functools.lru_cache(maxsize=8)
def _task(task_json: str):
    from fedsim.tasks import CLASSIFICATION, Task

    node = json.loads(task_json)
    if not node:
        return CLASSIFICATION
    task = _instantiate("task", OmegaConf.create(node))
    metric = getattr(task, "metric", None)
    if not (isinstance(metric, str) and re.fullmatch(r"[a-z][a-z0-9_]*", metric)) or metric == "loss":
        raise ConfigError(
            "task._target_",
            node.get("_target_"),
            "a task whose metric is a lower-case name other than 'loss' (letters, digits, _), e.g. 'f1'",
            f"Its metric is {metric!r}: it names the eval_<metric> fields, and eval_loss is the loss's.",
        )
    missing = [m for m in ("loss", "score", "finish") if getattr(type(task), m, None) is getattr(Task, m)]
    if not isinstance(task, Task) or missing:
        raise ConfigError(
            "task._target_",
            node.get("_target_"),
            "a subclass of fedsim.tasks.Task that defines loss, score and finish"
            + (f" ({', '.join(missing)} missing)" if isinstance(task, Task) else ""),
        )
    return task


def build_task(spec: dict):
    """The run's task (``fedsim.tasks``): its loss and metric; classification when the spec names none."""
    return _task(json.dumps(spec.get("task") or {}, sort_keys=True))


def check_task(task, ds: Dataset, dataset_name: object) -> None:
    """Refuse a task whose kind of labels is not the data set's (e.g. regression targets with accuracy)."""
    if task.targets != ds.targets:
        kind = {"classes": "class labels", "values": "real-valued targets"}
        raise ConfigError(
            "task",
            task.name,
            f"a task for {kind.get(ds.targets, ds.targets)} (the labels of dataset {dataset_name})",
            f"{task.name} learns from {kind.get(task.targets, task.targets)}: use "
            + ("task=regression" if ds.targets == "values" else "task=classification")
            + " with this data set, or another data set.",
        )


def model_factory(spec: dict):
    """A callable ``(input_shape, num_classes) -> nn.Module`` from the ``model`` section."""
    return _instantiate("model", OmegaConf.create(spec["model"]))


def build_initial_model(spec: dict) -> torch.nn.Module:
    """The global model at round 0, initialised from the run's seed."""
    ds = build_dataset(spec)
    return _initial_model(spec, tuple(ds.input_shape), int(ds.num_classes))


def _initial_model(spec: dict, input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    try:
        return build_model(model_factory(spec), input_shape, num_classes, seed=int(spec["seed"]))
    except ConfigError as e:
        raise e.with_prefix("model") from None


DEFAULT_CLIENT_ALGORITHM = "fedsim.algorithms.base.LocalSGD"


def local_training(spec: dict) -> LocalTraining:
    """The client's local optimiser settings from the ``client`` section (its other keys are the algorithm's)."""
    fields = LocalTraining.__dataclass_fields__
    return typed("client", LocalTraining, {k: v for k, v in spec["client"].items() if k in fields})


def _algorithm_class(target: str, key: str = "client._target_"):
    from hydra.utils import get_object

    from fedsim.algorithms.base import ClientAlgorithm

    try:
        cls = get_object(target)
    except Exception:  # noqa: BLE001  (any import failure is the same config error)
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, ClientAlgorithm)):
        raise ConfigError(
            key, target, "a client algorithm class (a subclass of fedsim.algorithms.base.ClientAlgorithm)"
        )
    return cls


@functools.lru_cache(maxsize=16)
def _client_algorithm(client_json: str):
    section = json.loads(client_json)
    target = section.pop("_target_", None) or DEFAULT_CLIENT_ALGORITHM
    local = local_training({"client": section})
    extra = {k: v for k, v in section.items() if k not in LocalTraining.__dataclass_fields__}
    cls = _algorithm_class(target)
    try:
        return check_user_metrics(cls(local, **extra))
    except TypeError as e:
        m = re.search(r"unexpected keyword argument '(\w+)'", str(e))
        if not m:
            raise
        params = [p for p in _parameters(target) if p != "local"]
        raise ConfigError(
            f"client.{m.group(1)}",
            extra.get(m.group(1)),
            f"an optimiser setting ({', '.join(LocalTraining.__dataclass_fields__)})"
            + (f" or a parameter of {cls.__name__}: {', '.join(params)}" if params else ""),
        ) from None
    except ConfigError as e:
        raise e.with_prefix("client") from None


def check_user_metrics(algorithm):
    """A user's client algorithm (a class outside fedsim) whose ``run.metrics`` hold a value a reply cannot carry
    (a string, None, a dict) fails with a line naming its class, file and the key, not Flower's type error."""
    import inspect

    cls = type(algorithm)
    if cls.__module__.split(".")[0] == "fedsim":
        return algorithm
    after = algorithm.after_training

    def after_training(run):
        after(run)
        for key, value in run.metrics.items():
            ok = isinstance(value, (int, float)) or (
                isinstance(value, list) and all(isinstance(v, (int, float)) for v in value)
            )
            if not ok or isinstance(value, bool):
                try:
                    where = f"{inspect.getsourcefile(cls)}: "
                except TypeError:
                    where = ""
                raise ConfigError(
                    "client._target_",
                    f"{cls.__module__}.{cls.__qualname__}",
                    "run.metrics of int or float values (or lists of them)",
                    f"{where}run.metrics[{key!r}] = {value!r:.60} ({type(value).__name__}).",
                )

    algorithm.after_training = after_training
    return algorithm


def client_algorithm(spec: dict):
    """The client algorithm of a spec's ``client`` section (built once per process)."""
    return _client_algorithm(json.dumps(spec["client"], sort_keys=True))


@dataclass
class ClientTask:
    """What one client keeps alive between messages: its data on the device and one model."""

    partition_id: int
    model: torch.nn.Module
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    local: LocalTraining
    seed: int
    device: str
    faults: FaultRates | None = None
    algorithm: Any = None  # the client algorithm (fedsim.algorithms); None: built from the spec when needed
    task: Any = None  # the loss and metric (fedsim.tasks); None: classification
    num_classes: int | None = None  # the model's outputs (None: ask the run's data set)

    def __post_init__(self) -> None:
        if self.task is None:
            from fedsim.tasks import CLASSIFICATION

            self.task = CLASSIFICATION


def fault_rates(spec: dict) -> FaultRates | None:
    """Injected-fault rates from the ``faults`` section (None when all are zero)."""
    rates = typed("faults", FaultRates, spec.get("faults") or {})
    return rates if any(vars(rates).values()) else None


_MODELS: dict[tuple[str, str], torch.nn.Module] = {}


def release_client_tasks() -> None:
    """Drop the clients' cached data and models (on the GPU too): a sweep's next job starts with free memory."""
    client_task.cache_clear()
    _MODELS.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _client_partition(spec: dict, partition_id: int, cache_dir: str | None):
    """Client ``partition_id``'s arrays, from the node's disk cache when ``cache_dir`` is set."""
    from fedsim import partition_cache

    path = partition_cache.cache_file(cache_dir, spec, partition_id) if cache_dir else None
    part = partition_cache.load(path) if path is not None else None
    if part is not None:
        return part
    ds = build_dataset(spec)
    train, val = build_partitions(spec)
    if not 0 <= partition_id < len(train):
        raise ConfigError("partition-id", partition_id, f"an integer in [0, {len(train)})")
    t, v = train[partition_id], val[partition_id]
    part = partition_cache.Partition(
        tuple(ds.input_shape),
        int(ds.num_classes),
        np.asarray(ds.x_train[t]),
        np.asarray(ds.y_train[t]),
        np.asarray(ds.x_train[v]),
        np.asarray(ds.y_train[v]),
    )
    if path is not None:
        partition_cache.save(path, part)
    return part


@functools.lru_cache(maxsize=4096)
def client_task(spec_json: str, partition_id: int, cache_dir: str | None = None) -> ClientTask:
    """Build and cache one client's task; the model object is shared by all clients of a worker.

    ``cache_dir``: a deployed node's partition cache (:mod:`fedsim.partition_cache`); a fresh process then
    reads its share from one file instead of building the data set.
    """
    spec = json.loads(spec_json)
    torch.set_num_threads(max(1, int(spec.get("threads", 1))))
    set_numerics(bool(spec.get("deterministic", False)))
    device = resolve_device(spec["device"], partition_id=partition_id)
    part = _client_partition(spec, partition_id, cache_dir)
    mkey = (json.dumps(spec["model"], sort_keys=True) + json.dumps(spec["dataset"], sort_keys=True), device)
    if mkey not in _MODELS:
        _MODELS[mkey] = _initial_model(spec, part.input_shape, part.num_classes).to(device)
    return ClientTask(
        partition_id,
        _MODELS[mkey],
        torch.as_tensor(part.x_train, device=device),
        torch.as_tensor(part.y_train, device=device),
        torch.as_tensor(part.x_val, device=device),
        torch.as_tensor(part.y_val, device=device),
        local_training(spec),
        int(spec["seed"]),
        device,
        fault_rates(spec),
        client_algorithm(spec),
        build_task(spec),
        num_classes=part.num_classes,
    )


# Config sections whose ``_target_`` other builders instantiate: never a strategy wrapper.
NOT_WRAPPERS = frozenset({"strategy", "heterogeneity", *CLIENT_SPEC_KEYS})


def wrapper_sections(cfg: DictConfig) -> list[tuple[str, type]]:
    """The config sections whose ``_target_`` is a strategy wrapper (``fedsim.strategies.wrapper.Wrapper``), with
    their classes, innermost first: by the class's ``fold_order``, then in config order.

    A user's feature needs no entry anywhere: its group's ``_target_`` names a ``Wrapper`` subclass.
    """
    from hydra.utils import get_object

    from fedsim.strategies.wrapper import Wrapper

    found = []
    for i, section in enumerate(cfg):
        node = cfg.get(section)
        if section in NOT_WRAPPERS or not isinstance(node, DictConfig):
            continue
        target = node.get("_target_")
        if not isinstance(target, str) or not target:
            continue
        try:
            cls = get_object(target)
        except Exception:
            _instantiate(str(section), node)
            raise
        if isinstance(cls, type) and issubclass(cls, Wrapper):
            found.append((cls.fold_order, i, str(section), cls))
    return [(section, cls) for _, _, section, cls in sorted(found, key=lambda f: f[:2])]
