"""What a deployed node admits from a message: the operator's run spec, and every value within its bounds.

Flower 1.42's Fleet API lets any registered SuperNode push an instruction to any other node, so on a deployed
node (``run_config`` holds ``overrides``) a message's config is data from the network (docs/deploy.md,
"Bounded messages"). Its run spec is checked against the operator's (``fedsim.run_spec``, re-exported here);
every other value fedsim's ClientApp reads from it is checked here, before anything is trained, against the
operator's spec: the local work a message asks may not exceed what the operator's ``client`` section asks,
and every other number has a documented range. Outside them the message is refused with one line
(:class:`MessageRefused`) and nothing is trained. :func:`refusing` turns either refusal into an error reply
and one line of the node's log: no exception reaches Flower's ``run_clientapp``, which would log "ClientApp
raised an exception" with a traceback and exit with status 800.

================================  =================================================================
key                               allowed
================================  =================================================================
``local-epochs``                  an integer from 1 to the operator's ``client.local_epochs`` (1 when
                                  the operator's spec counts ``client.local_steps``)
``lr``                            a number in (0, the operator's ``client.lr``]
``max-steps``                     an integer in [0, 2**31 - 1] (it only caps the operator's steps)
``proximal-mu``, ``feddyn-alpha``,
``ditto-lambda``                  a number in [0, ``MAX_PENALTY``]
``clip-norm``, ``clipping_norm``  a finite number > 0
``server-round``, ``model-version``,
``task-id``                       an integer in [0, ``MAX_INDEX``]
``compress``                      ``topk`` or ``qsgd``
``compress-ratio``                a number in (0, 1]
``compress-levels``               an integer in [1, 2**31 - 1]
``fedper-layers``                 text of at most ``MAX_TEXT`` characters
``attack-label-flip``             at most ``MAX_LIST`` integers >= 0
================================  =================================================================

The batch size, the optimiser and everything else of local training come only from the operator's spec.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from flwr.app import Context, Error, Message
from flwr.common.constant import ErrorCode

from fedsim import keys
from fedsim.checks import integer, is_integer, is_number, number
from fedsim.errors import ConfigError
from fedsim.local import LocalTraining
from fedsim.run_config import OVERRIDES
from fedsim.run_spec import MissingSpecError, SpecRefused, run_spec, spec_from_overrides

__all__ = [
    "MAX_INDEX",
    "MAX_LIST",
    "MAX_PENALTY",
    "MAX_TEXT",
    "REFUSALS",
    "MessageRefused",
    "MissingSpecError",
    "SpecRefused",
    "admitted_spec",
    "check_config",
    "refusing",
    "run_spec",
    "spec_from_overrides",
]
log = logging.getLogger("fedsim")

MAX_PENALTY = 100.0  # proximal, FedDyn and Ditto weights (papers use 0.001 .. 1)
MAX_INDEX = 2**53  # rounds, model versions, task ids
MAX_TEXT = 4096  # characters of a text value
MAX_LIST = 100_000  # entries of a list value
MAX_INT32 = 2**31 - 1
CODECS = ("topk", "qsgd")


class MessageRefused(ValueError):
    """A value in a deployed node's message lies outside its bounds: one line; nothing was trained."""


def _epochs(value: Any, local: LocalTraining) -> None:
    top = local.local_epochs if local.local_steps == 0 else 1
    if is_number(value) and not is_integer(value) and math.isfinite(value) and float(value).is_integer():
        value = int(value)  # 2.0 means 2 (fedsim.messages.flower_train_config reads it so)
    integer(
        "local-epochs", value, 1, top, what=f"an integer in [1, {top}] (the operator's client.local_epochs)"
    )


def _lr(value: Any, local: LocalTraining) -> None:
    number(
        "lr",
        value,
        0.0,
        local.lr,
        lo_open=True,
        what=f"a number in (0, {local.lr:g}] (the operator's client.lr)",
    )


def _codec(value: Any, local: LocalTraining) -> None:
    if value not in CODECS:
        raise ConfigError("compress", value, f"one of {', '.join(CODECS)}")


def _text(key: str) -> Callable[[Any, LocalTraining], None]:
    def check(value: Any, local: LocalTraining) -> None:
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            raise ConfigError(key, str(value)[:40], f"text of at most {MAX_TEXT} characters")

    return check


def _ids(key: str) -> Callable[[Any, LocalTraining], None]:
    def check(value: Any, local: LocalTraining) -> None:
        values = value if isinstance(value, list) else [value]
        if len(values) > MAX_LIST:
            raise ConfigError(key, f"<{len(values)} entries>", f"at most {MAX_LIST} integers >= 0")
        for v in values:
            integer(key, v, 0, what=f"at most {MAX_LIST} integers >= 0")

    return check


def _in(key: str, lo: float, hi: float, lo_open: bool = False) -> Callable[[Any, LocalTraining], None]:
    return lambda value, local: number(key, value, lo, hi, lo_open=lo_open)


def _int(key: str, lo: int, hi: int) -> Callable[[Any, LocalTraining], None]:
    return lambda value, local: integer(key, value, lo, hi)


def _rules() -> dict[str, Callable[[Any, LocalTraining], None]]:
    from fedsim import codecs
    from fedsim.features.feddyn.client import ALPHA
    from fedsim.features.personal.client import DITTO_LAMBDA, FEDPER_LAYERS
    from fedsim.messages import FLOWER_EPOCHS, FLOWER_LR

    rules = {
        FLOWER_EPOCHS: _epochs,
        FLOWER_LR: _lr,
        keys.MAX_STEPS: _int(keys.MAX_STEPS, 0, MAX_INT32),
        keys.CLIP_NORM: _in(keys.CLIP_NORM, 0.0, float("inf"), lo_open=True),
        keys.FLOWER_CLIPPING_NORM: _in(keys.FLOWER_CLIPPING_NORM, 0.0, float("inf"), lo_open=True),
        codecs.KIND: _codec,
        codecs.RATIO: _in(codecs.RATIO, 0.0, 1.0, lo_open=True),
        codecs.LEVELS: _int(codecs.LEVELS, 1, MAX_INT32),
        FEDPER_LAYERS: _text(FEDPER_LAYERS),
        keys.LABEL_FLIP: _ids(keys.LABEL_FLIP),
    }
    for key in (keys.PROXIMAL_MU, ALPHA, DITTO_LAMBDA):
        rules[key] = _in(key, 0.0, MAX_PENALTY)
    for key in (keys.SERVER_ROUND, keys.MODEL_VERSION, keys.TASK_ID):
        rules[key] = _int(key, 0, MAX_INDEX)
    return rules


def check_config(config: Mapping[str, Any], local: LocalTraining, what: str) -> None:
    """Refuse ``config`` (a message's train or evaluate config) when a value fedsim's ClientApp reads from it
    lies outside its bounds (the module's table; ``local``: the operator's local training).

    ``what`` names the message in the refusal, e.g. ``"train message 5e1f..."``.

    Raises
    ------
    MessageRefused
        One line: the message, the key, the value and what is allowed; nothing was trained.
    """
    rules = _rules()
    for key, value in config.items():
        rule = rules.get(key)
        if rule is None:
            continue
        try:
            rule(value, local)
        except ConfigError as e:
            raise MessageRefused(f"fedsim's ClientApp refused {what}: {e} Nothing was trained.") from None


def admitted_spec(msg: Message, context: Context) -> str:
    """The run spec to build from (``fedsim.run_spec.run_spec``), once the message's config is within its
    bounds on a deployed node (:func:`check_config`; fedsim's own simulation engines: not checked, their
    messages come from the operator's own server). Raises ``SpecRefused`` or :class:`MessageRefused`."""
    spec = run_spec(msg, context)
    if OVERRIDES in context.run_config and msg.has_content():
        config = msg.content.config_records.get(keys.CONFIG)
        if config is not None:
            from fedsim.build import local_training

            what = f"{msg.metadata.message_type} message {str(msg.metadata.message_id)[:16] or '(no id)'}"
            check_config(config, local_training(json.loads(spec)), what)
    return spec


REFUSALS = (SpecRefused, MessageRefused)  # a message refused: one line in the reply and in the node's log


def refusing(handler: Callable[[Message, Context], Message]) -> Callable[[Message, Context], Message]:
    """``handler`` answering a refused message (``REFUSALS``) with an error reply, its line logged once."""

    @functools.wraps(handler)
    def answer(msg: Message, context: Context) -> Message:
        try:
            return handler(msg, context)
        except REFUSALS as e:
            line = str(e).splitlines()[0] if str(e) else type(e).__name__
            log.error("%s", line)
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=line), reply_to=msg)

    return answer
