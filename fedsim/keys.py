"""Message, metric and config keys, in one place (kebab-case, like Flower's)."""

# Records inside a Message's RecordDict
ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"

# ConfigRecord keys sent to clients
SERVER_ROUND = "server-round"  # set by Flower strategies
RUN_SPEC = "fedsim-spec"  # JSON of the resolved run config (task, data, client training)
MODEL_VERSION = "model-version"  # server model version the client starts from
PROXIMAL_MU = "proximal-mu"  # set by Flower's FedProx
CLIP_NORM = "clip-norm"  # client-side clipping of the update (set by fedsim.features.clipping.server)
FLOWER_CLIPPING_NORM = "clipping_norm"  # Flower's client-side DP (flwr.supercore.differential_privacy)
LABEL_FLIP = "attack-label-flip"  # the partition ids that train on flipped labels (attack=label_flip)
PROBE_TRAIN = "probe-train-loss"  # evaluate config: report the loss on the training split (selection probes)
TASK_ID = "task-id"  # async loop: index of this task (seeds local training and injected faults)
MAX_STEPS = "max-steps"  # at most this many local steps (partial work before a deadline)

# MetricRecord keys returned by clients
NUM_EXAMPLES = "num-examples"
TRAIN_LOSS = "train-loss"
PARTITION_ID = "partition-id"
NUM_STEPS = "num-steps"
EXAMPLES_PROCESSED = "examples-processed"  # examples seen in local training (for simulated time)
EVAL_LOSS = "eval-loss"
EVAL_ACCURACY = "eval-accuracy"  # a task's metric M is replied as eval-M (see eval_metric)
CLIPPED = "clipped"  # 1.0 if the client clipped its update, else 0.0
UPDATE_NORM = "update-norm"  # L2 norm of the client's update before clipping

# MetricRecord keys that strategies may add to their aggregated train metrics.
# Every key in that record lands in metrics.jsonl with '-' turned into '_'.
AGG_CLIP_NORM = "clip-norm"
AGG_CLIPPED_FRACTION = "clipped-fraction"
AGG_EPSILON = "epsilon"
AGG_NOISE_STD = "noise-std"
AGG_NOISY_UNCLIPPED_FRACTION = "noisy-unclipped-fraction"  # DP adaptive clipping: the private estimate b~

# node_config keys (simulation sets the first two; deployment passes them with --node-config)
NODE_PARTITION_ID = "partition-id"
NODE_NUM_PARTITIONS = "num-partitions"
NODE_DATA_DIR = "data-dir"
NODE_CACHE_DIR = "cache-dir"  # deployment: where a node keeps its partition (fedsim.partition_cache)
NODE_STATE_DIR = "state-dir"  # simulation: the run folder's client_state/ (per-client persistent state)


def eval_metric(metric: str) -> str:
    """The evaluation reply's key of a task's metric (``accuracy`` -> ``eval-accuracy``)."""
    return f"eval-{metric}"
