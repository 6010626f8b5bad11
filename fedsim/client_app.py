"""fedsim's one Flower ClientApp: local training and evaluation on the node's own partition.

Every engine runs this same app; the node's partition comes from ``node_config``. The run's client spec (JSON:
data set, partitioner, model, client algorithm, each with its ``_target_``) is what the app builds code from,
so it is taken only from what the operator sets (docs/deploy.md, "Nothing runs because of a message"):

* Deployed (``run_config`` holds ``overrides``, the key declared in pyproject's ``[tool.flwr.app.config]``
  and set by whoever submits the run through the Control API): the app composes fedsim's config from it, as
  fedsim's ServerApp does, and derives the spec itself. The spec a message carries is data: checked against
  that one and, when it differs, refused with one line (``SpecRefused``) before anything is built. Flower's
  Fleet API lets any registered SuperNode push a message to any other node, so a message proves nothing.
  Under another ServerApp (Flower's own ``FedAvg``), messages carry no spec and the derived one is used.
* fedsim's own simulation engines (``run_config`` without ``overrides``): the messages come from the
  operator's own server through the engine (in this process, its worker pipes or Ray), never from the
  network, and their spec is used. Without one it fails with one line saying so.

Flower's client-side DP wrapper asks for clipping with ``clipping_norm``; the app clips to it as to fedsim's
``clip-norm``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import tempfile
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM  # "clipping_norm", Flower's client-side DP

from fedsim import attacks, compression, keys, selection
from fedsim.algorithms.base import LocalRun
from fedsim.algorithms.state import ClientState, ContextState, DirectoryState
from fedsim.build import ClientTask, build_dataset, client_algorithm, client_task
from fedsim.errors import ConfigError
from fedsim.faults import SimulatedTimeout
from fedsim.messages import global_state, incoming_arrays, parse_train, train_reply
from fedsim.node_data import node_partition, node_task
from fedsim.run_config import OVERRIDES
from fedsim.tasks import CLASSIFICATION
from fedsim.training import LocalTraining, evaluate, train_local

app = ClientApp()
log = logging.getLogger("fedsim")


class MissingSpecError(RuntimeError):
    """fedsim's ClientApp got a message without a run spec and has no run config to build one from."""


class SpecRefused(RuntimeError):
    """A message's run spec differs from the one the operator's run config composes: nothing is built."""


SPEC_FILE = "run-spec-{}.json"  # in a deployed node's cache-dir: the spec it derived for a run


@functools.lru_cache(maxsize=8)
def spec_from_overrides(overrides: str) -> str:
    """The client spec (JSON) fedsim's ServerApp sends for ``overrides`` (a shell-like string), derived here.

    The same composition and checks as the ServerApp (unknown keys, bad syntax), the same client algorithm
    (the strategy's client half, ``build.bind_client_algorithm``), so an honest message carries exactly it.

    Raises
    ------
    MissingSpecError
        The overrides do not compose (one line naming them).
    """
    from fedsim.build import bind_client_algorithm, build_strategy, client_spec
    from fedsim.run_config import DeployConfigError, experiment_from

    try:  # the same composition and checks (unknown keys, bad syntax) as fedsim's ServerApp
        cfg, _, _ = experiment_from({OVERRIDES: overrides})
        spec = json.loads(client_spec(cfg, device=str(cfg.placement.device)))
        # the cohort only sizes the strategy's own checks: the largest one passes whatever the server's does
        flwr_log = logging.getLogger("flwr")
        level = flwr_log.level
        flwr_log.setLevel(logging.ERROR)  # the strategy's warnings are the server's to give
        try:
            bind_client_algorithm(spec, build_strategy(cfg, int(cfg.num_clients)))
        finally:
            flwr_log.setLevel(level)
    except (ConfigError, DeployConfigError) as e:
        raise MissingSpecError(
            f"fedsim's ClientApp cannot build its task from run_config {OVERRIDES}: {e}"
        ) from None
    return json.dumps(spec, sort_keys=True)


def _operator_spec(overrides: str, context: Context) -> str:
    """``spec_from_overrides``, kept in the node's ``cache-dir`` per run (each message is a fresh process)."""
    cache_dir = context.node_config.get(keys.NODE_CACHE_DIR)
    if not cache_dir:
        return spec_from_overrides(overrides)
    digest = hashlib.sha256(f"{context.run_id}\n{overrides}".encode()).hexdigest()[:32]
    path = Path(str(cache_dir)).expanduser() / SPEC_FILE.format(digest)
    try:  # written by this node for this run (never received): the spec is the operator's
        return path.read_text(encoding="utf-8")
    except OSError:
        pass
    spec = spec_from_overrides(overrides)
    with contextlib.suppress(OSError):  # a read-only cache only costs the composition again
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".run-spec-")  # mode 0600
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(spec)
        os.replace(tmp, path)
    return spec


def _differences(sent: dict, own: dict, prefix: str = "") -> list[str]:
    """The keys (dotted paths) where a received spec differs from the operator's."""
    out = []
    for k in sorted(set(sent) | set(own), key=str):
        a, b = sent.get(k), own.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}")
    return out


def run_spec(msg: Message, context: Context) -> str:
    """The run's client spec: the operator's when deployed (a message's is only checked against it), else the
    message's (fedsim's own simulation engines).

    Raises
    ------
    SpecRefused
        Deployed, and the message's spec differs from the operator's: one line naming the keys; nothing built.
    MissingSpecError
        Neither is there: one line saying what the app needs.
    """
    config = msg.content.config_records.get(keys.CONFIG) if msg.has_content() else None
    sent = str(config[keys.RUN_SPEC]) if config is not None and keys.RUN_SPEC in config else None
    overrides = context.run_config.get(OVERRIDES)
    if overrides is None:
        if sent is not None:
            return sent
        raise MissingSpecError(
            f"fedsim's ClientApp needs its run's config: run it under fedsim's ServerApp (which sends "
            f'{keys.RUN_SPEC!r} in every message), or declare {OVERRIDES} = "<fedsim overrides>" in '
            '[tool.flwr.app.config] (e.g. overrides = "num_clients=10 model=mlp") so that it composes the '
            "same config as the ServerApp's model and data"
        )
    own = _operator_spec(str(overrides), context)
    if sent is not None and sent != own:
        try:
            theirs = json.loads(sent)
            diff = _differences(theirs, json.loads(own)) if isinstance(theirs, dict) else ["(not a mapping)"]
        except ValueError:
            diff = ["(not JSON)"]
        if diff:
            shown = ", ".join(d[:60] for d in diff[:6]) + (
                f" and {len(diff) - 6} more" if len(diff) > 6 else ""
            )
            raise SpecRefused(
                f"fedsim's ClientApp refused {msg.metadata.message_type} message "
                f"{str(msg.metadata.message_id)[:16] or '(no id)'}: its run spec differs from the one run_config "
                f"{OVERRIDES} composes ({shown}); nothing was built from it"
            )
    return own


def _task(spec: str, context: Context) -> ClientTask:
    """This node's task: its partition of the run's data set, or its own folder when ``data-dir`` is set."""
    partition_id = node_partition(context.node_config, spec)
    data_dir = context.node_config.get(keys.NODE_DATA_DIR)
    if data_dir:
        return node_task(spec, str(data_dir), partition_id)
    cache_dir = context.node_config.get(keys.NODE_CACHE_DIR)  # a deployed node's partition cache
    return client_task(spec, partition_id, str(cache_dir) if cache_dir else None)


def _load(task: ClientTask, arrays: ArrayRecord) -> None:
    """Load the global weights into the worker's model in place (``ValueError``, one line, when they do not fit)."""
    own = task.model.state_dict()
    got = {k: tuple(a.shape) for k, a in arrays.items()}
    missing, extra = sorted(set(own) - set(got)), sorted(set(got) - set(own))
    wrong = [k for k in own if k in got and tuple(own[k].shape) != got[k]]
    if missing or extra or wrong:
        what = [f"missing {missing[:3]}"] if missing else []
        what += [f"unexpected {extra[:3]}"] if extra else []
        what += [f"{k!r} has shape {got[k]}, this model's {tuple(own[k].shape)}" for k in wrong[:2]]
        raise ValueError(
            "the arrays received do not fit the model fedsim's config builds (" + "; ".join(what) + "): "
            "configure the same model on both sides (run_config overrides, e.g. model=...)"
        )
    task.model.load_state_dict(global_state(arrays), strict=True)  # parsed once per cohort in local engines


def _clip_to(task: ClientTask, start: dict[str, torch.Tensor], clip_norm: float) -> tuple[float, bool]:
    """Clip the update (model - start) to L2 norm ``clip_norm`` in place; return (pre-clip norm, clipped)."""
    with torch.no_grad():
        state = task.model.state_dict()
        deltas = {k: state[k] - start[k] for k in start if torch.is_floating_point(start[k])}
        norm = math.sqrt(sum(float((d.double() ** 2).sum()) for d in deltas.values()))
        if norm <= clip_norm or norm == 0.0:
            return norm, False
        scale = clip_norm / norm
        for k, d in deltas.items():
            state[k].copy_(start[k] + d * scale)
        return norm, True


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train on the local partition from the received global model."""
    spec = run_spec(msg, context)  # before anything is built
    task = _task(spec, context)
    ins = parse_train(_with_spec(msg, spec))
    clip_norm = _clip_norm(ins)
    algorithm = task.algorithm or client_algorithm(json.loads(ins.spec))
    local = flower_train_config(task.local, ins.unhandled, context.run_config, foreign=_foreign(msg))
    _load(task, msg.content[keys.ARRAYS])
    start = (
        {k: v.detach().clone() for k, v in task.model.state_dict().items()} if clip_norm is not None else None
    )
    run = LocalRun(
        task.model,
        ins,
        local,
        task.partition_id,
        start={n: p.detach().clone() for n, p in task.model.named_parameters() if p.requires_grad},
        incoming=incoming_arrays(msg.content),
        task=task.task or CLASSIFICATION,
    )
    compress = compression.wanted(ins.unhandled)  # compression=: top-k keeps its residual in the client state
    keep = algorithm.stateful or compress
    store = _state_store(context, task.partition_id, ins.draw_index) if keep else None
    if store is not None:
        run.state = store.load()
    loss, steps, seen = train_local(
        task.model,
        task.x_train,
        _labels(task, ins),
        local,
        ins.generator(task.seed, task.partition_id),
        max_steps=ins.max_steps,
        algorithm=algorithm,
        run=run,
    )
    if store is not None:
        store.save(run.state)
    extra = dict(run.metrics)
    if clip_norm is not None:
        norm, clipped = _clip_to(task, start, clip_norm)
        extra = {keys.UPDATE_NORM: norm, keys.CLIPPED: float(clipped)}
    state = {k: v.detach().cpu() for k, v in task.model.state_dict().items()}
    if task.faults is not None:
        state = _inject(task, ins.draw_index, state)
    if compress:
        global_arrays, pid = msg.content[keys.ARRAYS], task.partition_id
        state, kept = compression.encode_reply(
            state, global_arrays, ins.unhandled, run.state, task.seed, ins.draw_index, pid
        )
        store.save({**run.state, **kept})
    return train_reply(
        msg,
        state,
        num_examples=int(task.x_train.shape[0]),
        loss=loss,
        partition_id=task.partition_id,
        steps=steps,
        examples_processed=seen,
        extra=extra,
        outgoing=run.outgoing,
    )


# Flower's quickstart keys for local training: ``lr`` in the train config, ``local-epochs`` in the train config
# or the run config (its ClientApp reads ``context.run_config["local-epochs"]``)
FLOWER_LR, FLOWER_EPOCHS = "lr", "local-epochs"
_HONOURED = frozenset({FLOWER_LR, FLOWER_EPOCHS, KEY_CLIPPING_NORM})
_WARNED: set[tuple[str, ...]] = set()


def _foreign(msg: Message) -> bool:
    """True when the message comes from a ServerApp that is not fedsim's (it carries no run spec)."""
    config = msg.content.config_records.get(keys.CONFIG) if msg.has_content() else None
    return config is None or keys.RUN_SPEC not in config


def flower_train_config(local: LocalTraining, unhandled: dict, run_config, foreign: bool) -> LocalTraining:
    """``local`` with Flower's conventional ``lr`` and ``local-epochs`` applied, where a message (or, under a
    ServerApp that is not fedsim's, the run config) sets them; a bad value is one ``ConfigError`` line.

    Under a ServerApp that is not fedsim's, the other train-config keys that nothing in fedsim reads are named
    in one warning (once per set of keys), never ignored silently.
    """
    changes = {}
    if FLOWER_LR in unhandled:
        changes["lr"] = _number(FLOWER_LR, unhandled[FLOWER_LR])
    epochs = unhandled.get(FLOWER_EPOCHS, run_config.get(FLOWER_EPOCHS) if foreign else None)
    if epochs is not None:
        value = _number(FLOWER_EPOCHS, epochs)
        if value != int(value):
            raise ConfigError(FLOWER_EPOCHS, epochs, "an integer >= 1")
        changes.update(local_epochs=int(value), local_steps=0)
    if foreign:
        ignored = tuple(sorted(k for k in unhandled if k not in _HONOURED))
        if ignored and ignored not in _WARNED:
            _WARNED.add(ignored)
            log.warning(
                "fedsim's ClientApp ignores train-config key(s) %s (it reads %s, and %s)",
                ", ".join(repr(k) for k in ignored),
                f"{FLOWER_LR!r}, {FLOWER_EPOCHS!r}",
                f"{KEY_CLIPPING_NORM!r}; the rest of local training comes from run_config {OVERRIDES!r}",
            )
    return dataclasses.replace(local, **changes) if changes else local


def _number(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(key, value, "a number (train config)")
    return float(value)


def _with_spec(msg: Message, spec: str) -> ConfigRecord:
    """The message's train config holding ``spec`` (``run_spec``'s; a copy unless it holds that already)."""
    config = msg.content.config_records.get(keys.CONFIG)
    if config is not None and config.get(keys.RUN_SPEC) == spec:
        return config
    return ConfigRecord({**(dict(config.items()) if config is not None else {}), keys.RUN_SPEC: spec})


def _clip_norm(ins) -> float | None:
    """The clipping bound asked for: fedsim's ``clip-norm``, else Flower's ``clipping_norm``."""
    if ins.clip_norm is not None:
        return ins.clip_norm
    value = ins.unhandled.get(KEY_CLIPPING_NORM)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{KEY_CLIPPING_NORM}={value!r} in the train config: expected a number > 0")
    return float(value)


def _labels(task: ClientTask, ins) -> torch.Tensor:
    """The training labels: flipped (``C - 1 - y``) when ``attack=label_flip`` names this client an attacker."""
    if task.partition_id not in (ins.unhandled.get(attacks.LABEL_FLIP) or ()):
        return task.y_train
    classes = task.num_classes or build_dataset(json.loads(ins.spec)).num_classes
    return attacks.flip_labels(task.y_train, classes)


def _eval_split(task: ClientTask, cfg: ConfigRecord) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation split, or the training split for a selection probe (``probe-train-loss``)."""
    if cfg.get(selection.PROBE_TRAIN):
        return task.x_train, task.y_train
    return task.x_val, task.y_val


def _state_store(context: Context, partition_id: int, index: int) -> ClientState:
    """Where this client's persistent state lives: the run folder in simulation, the SuperNode in deployment."""
    root = context.node_config.get(keys.NODE_STATE_DIR)
    if root:
        return DirectoryState(str(root), partition_id, index)
    return ContextState(context.state)


def _inject(task: ClientTask, rnd: int, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Apply the seeded injected fault of this task, if any (see ``fedsim.faults``)."""
    kind = task.faults.draw(task.seed, rnd, task.partition_id)
    if kind == "error":
        raise RuntimeError(f"injected client error (partition {task.partition_id}, round {rnd})")
    if kind == "timeout":
        raise SimulatedTimeout(f"injected timeout (partition {task.partition_id}, round {rnd})")
    first = next(iter(state))
    if kind == "nan":
        state = {**state, first: torch.full_like(state[first], float("nan"))}
    elif kind == "shape":
        state = {**state, first: state[first].reshape(-1)[:-1].clone()}
    elif kind == "dtype":
        state = {k: v.double() for k, v in state.items()}
    return state


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    """Evaluate the model this client would use on its validation split: the global one, made personal by a
    personalised client algorithm (Ditto's personal model, FedPer's own layers) from the client's state."""
    spec = run_spec(msg, context)  # before anything is built
    task = _task(spec, context)
    _load(task, msg.content[keys.ARRAYS])
    cfg = msg.content.config_records.get(keys.CONFIG) or ConfigRecord()
    algorithm = task.algorithm or client_algorithm(json.loads(spec))
    if algorithm.stateful:  # the state this client saved in round r is version r: read it for round r's eval
        rnd = int(cfg.get(keys.SERVER_ROUND, 0))
        algorithm.personalize(task.model, _state_store(context, task.partition_id, rnd + 1).load())
    learnt = task.task or CLASSIFICATION
    loss, score = evaluate(task.model, *_eval_split(task, cfg), task=learnt)
    n = int(_eval_split(task, cfg)[0].shape[0])
    metrics = {
        keys.NUM_EXAMPLES: n,
        keys.EVAL_LOSS: 0.0 if n == 0 else loss,
        keys.eval_metric(learnt.metric): 0.0 if n == 0 or not math.isfinite(score) else score,
    }
    return Message(RecordDict({keys.METRICS: MetricRecord(metrics)}), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Report this node's partition id and size (used to map node ids to partitions)."""
    task = _task(run_spec(msg, context), context)
    metrics = {keys.PARTITION_ID: task.partition_id, keys.NUM_EXAMPLES: int(task.x_train.shape[0])}
    return Message(RecordDict({keys.METRICS: MetricRecord(metrics)}), reply_to=msg)
