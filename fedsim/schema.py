"""The fields of metrics.jsonl: one line per synchronous round or asynchronous server model version.

Both loops, the recorder, the sweep summary and the README's table use these names; a strategy's aggregated
train metrics add their own keys (``clip-norm`` becomes ``clip_norm``: see :func:`metric_field`).
"""

from __future__ import annotations

import re

ROUND = "round"
WALL_TIME = "wall_time"
ROUND_TIME = "round_time"
SIM_TIME = "sim_time"
NUM_CLIENTS = "num_clients"
TRAIN_LOSS = "train_loss"
EVAL_LOSS = "eval_loss"
EVAL_ACCURACY = "eval_accuracy"
FED_EVAL_PREFIX = "fed_"
FED_EVAL_LOSS = "fed_eval_loss"
FED_EVAL_ACCURACY = "fed_eval_accuracy"
PERSONAL_EVAL_ACCURACY = "personal_eval_accuracy"
PERSONAL_EVAL_ACCURACY_P10 = "personal_eval_accuracy_p10"
FAILURES = "failures"
FAILURE_KINDS = "failure_kinds"
SKIPPED = "skipped"
DROPPED_OUT = "dropped_out"
DROPPED_LATE = "dropped_late"
PARTIAL_WORK = "partial_work"
DROPPED_STALE = "dropped_stale"
STALENESS_MEAN = "staleness_mean"
STALENESS_MAX = "staleness_max"
UPDATES_TOTAL = "updates_total"
CLIP_NORM = "clip_norm"
CLIPPED_FRACTION = "clipped_fraction"
NOISY_UNCLIPPED_FRACTION = "noisy_unclipped_fraction"
CLIPPED = "clipped"
UPDATE_NORM = "update_norm"
NOISE_STD = "noise_std"
EPSILON = "epsilon"
MALICIOUS = "malicious"
BYTES_UP = "bytes_up"
BYTES_DOWN = "bytes_down"

# Config keys (dotted) whose values are secrets: written only to checkpoint.pt (a resumed run needs them), never
# to summary.json, Hydra's .hydra/ files, a logger, a callback or a sweep summary.
SECRET_KEYS = ("clipping.noise_seed",)
SECRET = "<secret>"  # what stands in their place

_ITEM = r"""(?>["']?[^\s,=:"'\[\](){}]+["']?)"""  # one value, never backtracked into
_SECRET_VALUE = re.compile(
    rf"""(\b(?:{"|".join(re.escape(k.rsplit(".", 1)[-1]) for k in SECRET_KEYS)})["']?\s*[:=]\s*)"""
    rf"(?:\w+\([^)]*\)|\[[^\]]*\]|{_ITEM}(?:\s*,\s*{_ITEM}(?![=:]))*)"
)


def redact_text(text: str) -> str:
    """``text`` with ``<secret>`` in place of every secret's value (``noise_seed=...``, ``noise_seed: ...``):
    also a sweep's ``1,2``, ``choice(1,2)``, ``range(1,9)`` or ``[1,2]``, and the secret in Hydra's
    ``override_dirname`` (``clipping.noise_seed=1,seed=0``), whose next override stays."""
    return _SECRET_VALUE.sub(lambda m: m.group(1) + SECRET, text)


def redact_file(path) -> None:
    """Rewrite the text file ``path`` with :func:`redact_text` (atomically; a missing or unreadable file is left)."""
    import contextlib
    import os
    from pathlib import Path

    path = Path(path)
    with contextlib.suppress(OSError, UnicodeDecodeError):
        text = path.read_text(encoding="utf-8")
        hidden = redact_text(text)
        if hidden != text:
            tmp = path.with_name(
                f".{path.name}.{os.getpid()}.tmp"
            )  # parallel jobs redact the same multirun.yaml
            tmp.write_text(hidden, encoding="utf-8")
            os.replace(tmp, path)


# Fields measured on the wall clock: they differ between two runs that compute the same thing.
WALL_CLOCK = (WALL_TIME, ROUND_TIME)

# Under DP (clipping.noise_multiplier > 0): the fields that are post-processing of the private releases (with the
# task's eval_<metric>), and every other field a sync round may write: exact statistics of the cohort and its
# replies, written for the operator and outside the guarantee (README, "Privacy", "Not covered").
DP_COVERED = (ROUND, CLIP_NORM, NOISE_STD, NOISY_UNCLIPPED_FRACTION, EPSILON, EVAL_LOSS, EVAL_ACCURACY)
DP_NOT_COVERED = (
    NUM_CLIENTS,
    TRAIN_LOSS,
    FAILURES,
    FAILURE_KINDS,
    SKIPPED,
    DROPPED_OUT,
    DROPPED_LATE,
    PARTIAL_WORK,
    MALICIOUS,
    BYTES_UP,
    BYTES_DOWN,
    ROUND_TIME,
    WALL_TIME,
    SIM_TIME,
    FED_EVAL_LOSS,
    FED_EVAL_ACCURACY,
    PERSONAL_EVAL_ACCURACY,
    PERSONAL_EVAL_ACCURACY_P10,
    CLIPPED_FRACTION,
    CLIPPED,
    UPDATE_NORM,
)

FIELDS: dict[str, str] = {
    ROUND: "round (sync) or server model version (async); 0 is the initial model",
    WALL_TIME: "seconds since the run started",
    ROUND_TIME: "wall seconds this round took",
    SIM_TIME: "simulated seconds (the heterogeneity model's clock; wall seconds in deployment's async loop)",
    NUM_CLIENTS: "updates aggregated",
    TRAIN_LOSS: "clients' mean local training loss",
    EVAL_LOSS: "the global model's loss on the server's test split",
    EVAL_ACCURACY: "the global model's accuracy on the server's test split",
    FED_EVAL_LOSS: "federated evaluation on the cohort's validation splits (`federated_eval=true`)",
    FED_EVAL_ACCURACY: "federated evaluation accuracy (`federated_eval=true`)",
    PERSONAL_EVAL_ACCURACY: "federated evaluation: mean over the clients of the accuracy of the model each would use "
    "(its personal one under Ditto or FedPer)",
    PERSONAL_EVAL_ACCURACY_P10: "federated evaluation: 10th percentile over the clients of that accuracy",
    FAILURES: "replies dropped: errors, timeouts, NaN/Inf, wrong shapes",
    FAILURE_KINDS: "those failures by kind",
    SKIPPED: "true when the round kept the old model (too few valid replies; never under DP with noise, where "
    "such a round releases the model plus its noise)",
    DROPPED_OUT: "sampled clients that dropped out (heterogeneity)",
    DROPPED_LATE: "sampled clients past the round's deadline",
    PARTIAL_WORK: "clients that sent the steps they finished before the deadline",
    DROPPED_STALE: "async: updates staler than `max_staleness`",
    STALENESS_MEAN: "async: mean staleness of the version's updates",
    STALENESS_MAX: "async: largest staleness of the version's updates",
    UPDATES_TOTAL: "async: updates accepted so far",
    CLIP_NORM: "clipping: the clip norm used this round",
    CLIPPED_FRACTION: "clipping without noise (or with `clipping.debug_metrics`): share of updates clipped",
    NOISY_UNCLIPPED_FRACTION: "DP adaptive clipping: the noised share of unclipped updates the clip norm follows",
    CLIPPED: "client-side clipping without noise (or with `clipping.debug_metrics`): mean of the clients' clipped flags",
    UPDATE_NORM: "client-side clipping without noise (or with `clipping.debug_metrics`): mean update norm before clipping",
    NOISE_STD: "clipping: standard deviation of the Gaussian noise",
    EPSILON: "DP: epsilon spent so far at `clipping.delta`",
    MALICIOUS: "attack: replies of the round that came from malicious clients (`attack=`)",
    BYTES_UP: "sync: serialised size in bytes of the round's train replies and selection probes' replies "
    "(clients to server)",
    BYTES_DOWN: "sync: serialised size in bytes of the round's train messages and selection probes "
    "(server to clients)",
}


def eval_field(metric: str, prefix: str = "") -> str:
    """The field of a task's evaluation metric: ``eval_<metric>``, with ``prefix`` ``fed_`` or ``personal_``."""
    return f"{prefix}eval_{metric}"


def task_fields(metric: str) -> dict[str, str]:
    """The fields named after the task's metric (``accuracy`` for classification, ``r2`` for regression), with
    their descriptions: :data:`FIELDS` lists them for accuracy."""
    names = {
        EVAL_ACCURACY: eval_field(metric),
        FED_EVAL_ACCURACY: eval_field(metric, FED_EVAL_PREFIX),
        PERSONAL_EVAL_ACCURACY: eval_field(metric, "personal_"),
        PERSONAL_EVAL_ACCURACY_P10: eval_field(metric, "personal_") + "_p10",
    }
    return {names[k]: FIELDS[k].replace("accuracy", metric) for k in names}


def fields(metric: str = "accuracy") -> dict[str, str]:
    """Every field a run with a task whose metric is ``metric`` may write, with its description."""
    return {**FIELDS, **task_fields(metric)}


def metric_field(key: str) -> str:
    """The metrics.jsonl field of a strategy's MetricRecord key (``clip-norm`` -> ``clip_norm``)."""
    return key.replace("-", "_")
