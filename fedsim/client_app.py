"""fedsim's one Flower ClientApp: local training and evaluation on the node's own partition.

Every engine runs this same app; the node's partition comes from ``node_config``. The run's client spec (JSON:
data set, partitioner, model, client algorithm, each with its ``_target_``) is what the app builds code from,
so it is taken only from what the operator sets (docs/deploy.md, "Nothing runs because of a message"), and on a
deployed node every other value the app reads from a message is bounded (``fedsim.admission``; a refusal is an
error reply and one line of the node's log):

* Deployed (``run_config`` holds ``overrides``, the key declared in pyproject's ``[tool.flwr.app.config]``
  and set by whoever submits the run through the Control API): the app composes fedsim's config from it, as
  fedsim's ServerApp does, and derives the spec itself. The spec a message carries is data: checked against
  that one and, when it differs, refused with one line (``SpecRefused``) before anything is built. Flower's
  Fleet API lets any registered SuperNode push a message to any other node, so a message proves nothing.
  Under another ServerApp (Flower's own ``FedAvg``), messages carry no spec and the derived one is used.
* fedsim's own simulation engines (``run_config`` without ``overrides``): the messages come from the
  operator's own server through the engine (in this process, its worker pipes or Ray), never from the
  network, and their spec is used. Without one it fails with one line saying so.

One local training, in order: the run spec (``fedsim.run_spec``), this node's task (``fedsim.node_data``), the
instruction (``fedsim.messages``), the client algorithm with the client halves the run's features name
(``fedsim.algorithms.halves``: client-side clipping, injected faults, label flipping, compression), the
client's persistent state (``fedsim.algorithms.state``), training (``fedsim.training``), the reply. Nothing
here is specific to one feature, and nothing server-side is imported.

Flower's client-side DP wrapper asks for clipping with ``clipping_norm``; the app clips to it as to fedsim's
``clip-norm``.
"""

from __future__ import annotations

import logging
import math

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedsim import keys
from fedsim.admission import (  # noqa: F401  (re-exported: fedsim.deploy and tests take them from here)
    MissingSpecError,
    SpecRefused,
    admitted_spec,
    refusing,
    run_spec,
    spec_from_overrides,
)
from fedsim.algorithms import halves
from fedsim.messages import flower_train_config, global_state, incoming_arrays, parse_train, train_reply
from fedsim.node_data import task_for
from fedsim.training import evaluate, train_local

app = ClientApp()
log = logging.getLogger("fedsim")


def _load(task, arrays: ArrayRecord) -> None:
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


@app.train()
@refusing
def train(msg: Message, context: Context) -> Message:
    """Train on the local partition from the received global model."""
    spec = admitted_spec(msg, context)  # before anything is built
    task = task_for(spec, context.node_config)
    ins = parse_train(_with_spec(msg, spec))
    local = flower_train_config(task.local, ins.unhandled, context.run_config, foreign=_foreign(msg))
    _load(task, msg.content[keys.ARRAYS])
    chain = halves.ClientChain.build(spec, task, ins, context.node_config, context.state)
    run = chain.local_run(task, ins, local, incoming_arrays(msg.content))
    loss, steps, seen = train_local(
        task.model,
        task.x_train,
        chain.labels(task, ins),
        local,
        ins.generator(task.seed, task.partition_id),
        max_steps=ins.max_steps,
        algorithm=chain.algorithm,
        run=run,
    )
    reply = chain.reply(task, run)
    return train_reply(
        msg,
        reply.model,
        num_examples=int(task.x_train.shape[0]),
        loss=loss,
        partition_id=task.partition_id,
        steps=steps,
        examples_processed=seen,
        extra=reply.metrics,
        outgoing=run.outgoing,
    )


def _foreign(msg: Message) -> bool:
    """True when the message comes from a ServerApp that is not fedsim's (it carries no run spec)."""
    config = msg.content.config_records.get(keys.CONFIG) if msg.has_content() else None
    return config is None or keys.RUN_SPEC not in config


def _with_spec(msg: Message, spec: str) -> ConfigRecord:
    """The message's train config holding ``spec`` (``run_spec``'s; a copy unless it holds that already)."""
    config = msg.content.config_records.get(keys.CONFIG)
    if config is not None and config.get(keys.RUN_SPEC) == spec:
        return config
    return ConfigRecord({**(dict(config.items()) if config is not None else {}), keys.RUN_SPEC: spec})


@app.evaluate()
@refusing
def evaluate_fn(msg: Message, context: Context) -> Message:
    """Evaluate the model this client would use on its validation split: the global one, made personal by a
    personalised client algorithm (Ditto's personal model, FedPer's own layers) from the client's state."""
    spec = admitted_spec(msg, context)  # before anything is built
    task = task_for(spec, context.node_config)
    _load(task, msg.content[keys.ARRAYS])
    cfg = msg.content.config_records.get(keys.CONFIG) or ConfigRecord()
    algorithm = task.algorithm
    if algorithm.stateful:  # the state this client saved in round r is version r: read it for round r's eval
        rnd = int(cfg.get(keys.SERVER_ROUND, 0))
        state = halves.saved_state(context.node_config, context.state, task.partition_id, rnd + 1)
        algorithm.personalize(task.model, state)
    x, y = task.x_val, task.y_val
    for half in halves.chain(spec):  # e.g. a selection probe is answered on the training split
        split = half.eval_data(cfg, task.x_train, task.y_train, task.x_val, task.y_val)
        if split is not None:
            x, y = split
            break
    learnt = task.task
    loss, score = evaluate(task.model, x, y, task=learnt)
    n = int(x.shape[0])
    metrics = {
        keys.NUM_EXAMPLES: n,
        keys.EVAL_LOSS: 0.0 if n == 0 else loss,
        keys.eval_metric(learnt.metric): 0.0 if n == 0 or not math.isfinite(score) else score,
    }
    return Message(RecordDict({keys.METRICS: MetricRecord(metrics)}), reply_to=msg)


@app.query()
@refusing
def query(msg: Message, context: Context) -> Message:
    """Report this node's partition id and size (used to map node ids to partitions)."""
    task = task_for(admitted_spec(msg, context), context.node_config)
    metrics = {keys.PARTITION_ID: task.partition_id, keys.NUM_EXAMPLES: int(task.x_train.shape[0])}
    return Message(RecordDict({keys.METRICS: MetricRecord(metrics)}), reply_to=msg)
