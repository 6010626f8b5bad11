"""Reliability, round two (issue 16): signals, folder locks, write failures, safe checkpoints, strict input.

Quick tests exercise the pieces (signal guard, lock, recorder, checkpoint reader, reply screening, validation);
the end-to-end ones (marked slow) run ``fedsim`` as a user does: kill it, point two runs at one folder, fill
the disk, resume a crafted checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import io
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY, compose_cfg, fedsim_cli, read_metrics, run_tiny, without_wall_time
from omegaconf import open_dict

from fedsim import checkpoint, schema
from fedsim.callbacks import Callback
from fedsim.errors import ConfigError, Interrupted, OutputError, RunError, critical, signals
from fedsim.recorder import Recorder, atomic_torch_save, lock_run_folder, unlock_run_folder
from fedsim.validate import validate


def _tmp_files(folder: Path) -> list[str]:
    return [p.name for p in Path(folder).rglob("*") if p.name.endswith(".tmp")]


class _Evil:
    """Pickles as a call of ``open(path, "w")``: loading it would create ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


# ------------------------------------------------------------------------------------------ signals (item 2)
def _send(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # Python runs the handler at the next bytecode boundary


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_sigterm_and_sighup_are_handled_like_ctrl_c(sig):
    before = signal.getsignal(sig)
    with pytest.raises(Interrupted) as caught, signals():
        _send(sig)
    assert isinstance(caught.value, KeyboardInterrupt) and caught.value.signum == sig
    assert signal.getsignal(sig) is before  # the previous handler is back


def test_a_signal_never_cuts_a_critical_write_and_is_only_noted_once_stopping():
    done = []
    with pytest.raises(Interrupted), signals(), critical():
        _send(signal.SIGTERM)
        done.append("write finished")  # reached: the signal waits for the section to end
    assert done == ["write finished"]
    with signals() as guard:
        guard.stopping()
        _send(signal.SIGINT)  # while the outputs are written: noted, not raised
        assert guard.first == signal.SIGINT


def test_after_an_interrupted_run_the_command_line_ignores_further_signals(monkeypatch):
    """A third Ctrl-C while the process exits used to kill it (exit status -2 instead of 130)."""
    import fedsim.errors as errors

    monkeypatch.setattr(errors, "IGNORE_AFTER_INTERRUPT", True)
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {s: signal.getsignal(s) for s in sigs}
    try:
        with pytest.raises(Interrupted), signals():
            _send(signal.SIGINT)
        assert all(signal.getsignal(s) is signal.SIG_IGN for s in sigs)
    finally:
        for s, handler in before.items():  # (ignored signals would be inherited by later test subprocesses)
            signal.signal(s, handler)
    with signals():
        pass  # no signal: the previous handlers come back
    assert {s: signal.getsignal(s) for s in sigs} == before


# ------------------------------------------------------------------------------------ run folder lock (item 1)
def test_a_folder_held_by_a_live_process_is_refused(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'4242\\n'); print('held', flush=True); time.sleep(60)",
            str(folder / ".fedsim.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=r"^hydra\.run\.dir=.*Process 4242 is running in it"):
            lock_run_folder(folder)
    finally:
        holder.kill()
        holder.wait()
    lock_run_folder(folder)  # the kernel dropped the dead holder's lock
    lock_run_folder(folder)  # the same process again: counted
    unlock_run_folder(folder)
    unlock_run_folder(folder)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="a folder fedsim can create and write in"):
        lock_run_folder(tmp_path / "afile")


def test_two_runs_started_in_the_same_second_get_their_own_folders(tmp_path, monkeypatch):
    import datetime

    import hydra.core.utils

    from fedsim import cli

    class Frozen(datetime.datetime):  # both calls in one second, whatever the clock does
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 1, 2, 3, 4, 5)

    monkeypatch.setattr(hydra.core.utils, "datetime", Frozen)  # what Hydra's ${now:...} resolver calls
    monkeypatch.chdir(tmp_path)
    first = cli.prepare_folders(["seed=1"])
    second = cli.prepare_folders(["seed=1"])  # the same ${now:...} value: a suffix
    try:
        a, b = (Path(x.split("=", 1)[1]) for x in (first[0], second[0]))
        assert a != b and b.name == a.name + "-1" and a.is_dir() and b.is_dir()
        assert "03-04-05" in str(a)
    finally:
        for x in (first, second):
            unlock_run_folder(Path(x[0].split("=", 1)[1]))


# ---------------------------------------------------------------------------------- write failures (item 3)
def test_a_failed_metrics_write_names_the_file_and_keeps_whole_lines(tmp_path, monkeypatch):
    rec = Recorder(tmp_path, 5, quiet=True)
    rec.log({schema.ROUND: 0, schema.EVAL_ACCURACY: 0.1, schema.EVAL_LOSS: 2.3})
    real = os.write

    def half_then_full(fd, data):
        real(fd, bytes(data)[:7])  # part of the line reaches the disk, then it is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OutputError, match=r"cannot write .*metrics\.jsonl: the disk is full"):
        rec.log({schema.ROUND: 1, schema.EVAL_ACCURACY: 0.2, schema.EVAL_LOSS: 2.0})
    monkeypatch.setattr(os, "write", real)
    rec.close()
    assert [r["round"] for r in read_metrics(tmp_path)] == [0]  # no half line left


def test_a_failed_atomic_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    def full(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OutputError, match=r"cannot write .*model\.pt: the disk is full"):
        atomic_torch_save({"w": torch.zeros(3)}, tmp_path / "model.pt")
    assert list(tmp_path.iterdir()) == []


def test_the_progress_line_survives_a_diverged_loss(tmp_path):
    rec = Recorder(tmp_path, num_rounds=3, quiet=True)
    line = rec.progress_line({"round": 2, "eval_accuracy": 0.1, "eval_loss": None, "wall_time": 1.0})
    assert "loss nan" in line


# --------------------------------------------------------------------------------- strict input (items 4, 8)
@pytest.mark.slow
def test_on_off_keys_take_only_true_or_false():
    assert compose_cfg("quiet=no").quiet == "no"  # what Hydra hands over: a string, not a bool
    base = compose_cfg()
    for key, value in [
        ("quiet", "no"),
        ("stop_at_target", "no"),
        ("federated_eval", "no"),
        ("quiet", "maybe"),
        ("quiet", 1),
        ("heterogeneity.partial_work", "yes"),
        ("placement.deterministic", "off"),
    ]:
        cfg = copy.deepcopy(base)
        with open_dict(cfg):
            node, _, leaf = key.rpartition(".")
            (cfg[node] if node else cfg)[leaf] = value
        with pytest.raises(ConfigError, match=f"^{key}={value!r} is not allowed: expected true or false"):
            validate(cfg)


def test_seed_beyond_64_bits_and_a_missing_group_are_config_errors():
    cfg = compose_cfg()
    with open_dict(cfg):
        cfg.seed = 2**64
    with pytest.raises(ConfigError, match=r"^seed=18446744073709551616 is not allowed"):
        validate(cfg)
    cfg.seed = 2**64 - 1
    validate(cfg)
    with open_dict(cfg):
        del cfg["strategy"]
    with pytest.raises(ConfigError, match=r"^strategy=None is not allowed: expected one of .*fedavg"):
        validate(cfg)


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_labels_out_of_range_are_one_line_naming_the_file(tmp_path):
    from fedsim.data.base import Dataset
    from fedsim.data.vision import load_mnist

    rng = np.random.default_rng(0)
    for split, n in (("train", 20), ("t10k", 10)):
        _write_idx(tmp_path / f"{split}-images-idx3-ubyte", rng.integers(0, 255, (n, 28, 28)))
        labels = rng.integers(0, 10, n)
        if split == "t10k":
            labels[3] = 255
        _write_idx(tmp_path / f"{split}-labels-idx1-ubyte", labels)
    with pytest.raises(ConfigError, match=r"^root=.*t10k-labels-idx1-ubyte holds label 255"):
        load_mnist(str(tmp_path), seed=0)
    x = np.zeros((4, 2), np.float32)
    with pytest.raises(ConfigError, match=r"class labels in \[0, 10\).*holds label 10"):
        Dataset("mine", x, np.array([0, 1, 2, 10]), x, np.arange(4), 10, (2,))


def test_a_data_set_too_big_for_memory_is_refused_before_it_is_built():
    from fedsim.data.synthetic_images import synthetic_images

    with pytest.raises(ConfigError, match=r"^num_classes=100000000 is not allowed: .* fit in memory"):
        synthetic_images(seed=0, num_classes=10**8)  # was: killed by the kernel's out-of-memory killer
    with pytest.raises(ConfigError, match=r"^num_train=10000000000 is not allowed"):
        synthetic_images(seed=0, num_train=10**10)


def test_a_group_level_error_is_named_once():
    from fedsim.features.faults.client import FaultRates
    from fedsim.groups import typed

    with pytest.raises(ConfigError, match=r"^faults=\{.*expected rates that sum to at most 1"):
        typed("faults", FaultRates, {"error": 0.6, "nan": 0.6})  # was: faults.faults={...}


def test_a_crafted_cifar_batch_runs_nothing(tmp_path):
    from fedsim.data.vision import load_cifar10

    marker = tmp_path / "pwned"
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 255, (2, 3072), dtype=np.uint8), "labels": [0, 1]}
        if name == "data_batch_2":
            batch["extra"] = _Evil(marker)
        (tmp_path / name).write_bytes(pickle.dumps(batch))
    with pytest.raises(ConfigError, match=r"^root=.*data_batch_2 holds a pickled"):
        load_cifar10(str(tmp_path), seed=0)
    assert not marker.exists()


# ------------------------------------------------------------------------------- safe checkpoints (item 7)
def _plain_checkpoint(**changes) -> dict:
    ckpt = {
        "format": 3,
        "round": 1,
        "sim_time": 0.0,
        "extra": {},
        "arrays": {"w": torch.zeros(2)},
        "strategy_state": None,
        "strategy_pickle": None,
        "records": [],
        "config": None,
    }
    ckpt.update(changes)
    return ckpt


class MakesFileOnNew:
    """A class whose ``__new__`` creates ``MakesFileOnNew.path`` (or the path it is given)."""

    path = ""

    def __new__(cls, path=None, **kwargs):
        Path(path or cls.path).write_text("pwned")
        return super().__new__(cls)


class MakesFileOnSetstate:
    """A class whose ``__setstate__`` creates the file its state names."""

    def __setstate__(self, state):
        Path(state["path"]).write_text("pwned")


def _payloads(marker: Path) -> dict[str, bytes]:
    """Hand-built pickles, one per opcode that can call something; a plain unpickler creates ``marker``."""
    path = str(marker).encode()
    mod = __name__.encode()
    p4 = pickle.PROTO + b"\x04"
    return {
        "REDUCE": b"cbuiltins\nopen\n(V" + path + b"\nVw\ntR.",
        "REDUCE-os": b"cos\nsystem\n(Vtouch " + path + b"\ntR.",
        "INST": b"(V" + path + b"\nVw\nibuiltins\nopen\n.",
        "OBJ": b"(cbuiltins\nopen\nV" + path + b"\nVw\no.",
        "NEWOBJ": b"\x80\x02c" + mod + b"\nMakesFileOnNew\nV" + path + b"\n\x85\x81.",
        "NEWOBJ_EX": p4 + b"c" + mod + b"\nMakesFileOnNew\n)}Vpath\nV" + path + b"\ns\x92.",
        "BUILD": b"\x80\x02c" + mod + b"\nMakesFileOnSetstate\n)\x81}Vpath\nV" + path + b"\nsb.",
        "nested-bytes": pickle.dumps({"blob": pickle.dumps(_Evil(marker))}),
    }


def test_every_payload_would_run_under_a_plain_unpickler(tmp_path):
    """The payloads below are real: a plain unpickler creates the marker file with each one (but the last,
    whose pickle is only data holding another pickle)."""
    for name, data in _payloads(tmp_path / "m").items():
        if name in ("REDUCE-os", "nested-bytes"):
            continue
        marker = tmp_path / "m"
        marker.unlink(missing_ok=True)
        with contextlib.suppress(Exception):
            pickle.loads(data)
        assert marker.exists(), name


def test_the_safe_unpickler_calls_and_imports_nothing_of_a_strategy_pickle(tmp_path):
    """Every opcode that can call is refused or, for a strategy's own class (NEWOBJ, BUILD), read as a record:
    the class is neither imported, constructed nor given its state."""
    marker = tmp_path / "m"
    MakesFileOnNew.path = str(marker)
    for name, data in _payloads(marker).items():
        try:
            out = checkpoint._StrategyPickleReader(io.BytesIO(data)).load()
        except checkpoint.UnsafePickle:
            out = None
        assert not marker.exists(), name
        assert out is None or isinstance(out, (checkpoint._Record, dict)), name
    no_args = b"\x80\x02c" + __name__.encode() + b"\nMakesFileOnNew\n)\x81."
    rec = checkpoint._StrategyPickleReader(io.BytesIO(no_args)).load()
    assert isinstance(rec, checkpoint._Record) and str(rec.cls).endswith("MakesFileOnNew")
    assert not marker.exists()
    for name in ("REDUCE", "REDUCE-os", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX"):
        with pytest.raises(checkpoint.UnsafePickle):
            checkpoint._StrategyPickleReader(io.BytesIO(_payloads(marker)[name])).load()


def _torch_file_with_pickle(path: Path, data_pkl: bytes) -> None:
    """A torch zip checkpoint whose top-level pickle is ``data_pkl`` (what torch.load unpickles first)."""
    import zipfile

    torch.save({"a": 1}, path)
    with zipfile.ZipFile(path) as z:
        entries = {n: z.read(n) for n in z.namelist()}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for n, content in entries.items():
            out.writestr(n, data_pkl if n.endswith("/data.pkl") else content)


def test_a_crafted_checkpoint_runs_nothing_and_is_one_line_naming_it(tmp_path):
    """Each payload in each field a resume reads (the file's own pickle; a format-2 strategy pickle; a format-3
    wrapper's pickled inner strategy, nested; an object where plain data belongs) is refused in one line, and
    no payload creates its file."""
    marker = tmp_path / "pwned"
    MakesFileOnNew.path = str(marker)
    cases: dict[str, object] = {}
    for field in ("extra", "records", "config", "arrays", "strategy_state", "strategy_attrs", "client_state"):
        cases[f"object-in-{field}.pt"] = _plain_checkpoint(**{field: {"x": _Evil(marker)}})
    for name, data in _payloads(marker).items():
        if name == "nested-bytes":
            continue
        cases[f"top-{name}.pt"] = data  # the file's own pickle
        cases[f"format2-{name}.pt"] = _plain_checkpoint(format=2, strategy_pickle=data)
        nested = {"clip_norm": 1.0, "inner": [{"inner_state": None, "inner_pickle": data}]}
        cases[f"format3-inner-{name}.pt"] = _plain_checkpoint(format=3, strategy_state=nested)
    from fedsim.strategies.fedavg import FedAvg

    for name, ckpt in cases.items():
        if isinstance(ckpt, bytes):
            _torch_file_with_pickle(tmp_path / name, ckpt)
        else:
            torch.save(ckpt, tmp_path / name)
        with pytest.raises(ConfigError, match=r"^resume=") as e:
            # a pickled object of a class the file names (BUILD's case) is read as a record and refused when it
            # is compared with the configured strategy; everything else is refused on reading
            checkpoint.restore(checkpoint.load(tmp_path / name), _State(), FedAvg())
        if "BUILD" not in name:
            assert name in str(e.value) and re.search("nothing of it was run|it was not loaded", str(e.value))
        assert "\n" not in str(e.value)
        assert not marker.exists(), name


def test_a_format2_record_of_another_class_is_refused_at_restore(tmp_path):
    """NEWOBJ without arguments of a class that is not the configured strategy: read as a record (nothing
    constructed), then refused in one line when the resume compares it with the configured strategy."""
    from fedsim.strategies.fedavg import FedAvg

    marker = tmp_path / "pwned"
    MakesFileOnNew.path = str(marker)
    data = b"\x80\x02c" + __name__.encode() + b"\nMakesFileOnNew\n)\x81}Vx\nK\x01sb."
    torch.save(_plain_checkpoint(format=2, strategy_pickle=data), tmp_path / "c.pt")
    ckpt = checkpoint.load(tmp_path / "c.pt")
    with pytest.raises(ConfigError, match=r"^resume='test_reliability\.MakesFileOnNew'.*FedAvg"):
        checkpoint.restore(ckpt, _State(), FedAvg())
    assert not marker.exists()


def test_bytes_in_a_strategys_state_stay_bytes(tmp_path):
    """A pickle inside plain data (a strategy attribute that is bytes, a state_dict entry) is data: kept as
    bytes, never unpickled."""
    marker = tmp_path / "pwned"
    blob = pickle.dumps(_Evil(marker))
    attrs = {"class": "fedsim.strategies.fedavg.FedAvg", "attrs": {"blob": ["plain", blob]}}
    torch.save(_plain_checkpoint(strategy_attrs=attrs, strategy_state=None), tmp_path / "c.pt")
    from fedsim.strategies.fedavg import FedAvg

    s = checkpoint.restore(checkpoint.load(tmp_path / "c.pt"), _State(), FedAvg())
    assert s.blob == blob and not marker.exists()


def test_no_free_unpickler_is_reachable():
    """fedsim's strategies module pickles and unpickles nothing; every pickle fedsim reads goes through
    SafeUnpickler."""
    import fedsim.checkpoint
    import fedsim.data.vision
    from fedsim.strategies import base

    assert not hasattr(base, "unpickle") and not hasattr(base, "pickle")
    sources = [Path(m.__file__).read_text() for m in (base, fedsim.checkpoint, fedsim.data.vision)]
    for src in sources:
        assert (
            "pickle.load(" not in src
            and "pickle.loads(" not in src
            and "Unpickler(f" not in src.replace("SafeUnpickler(f", "")
        )


class _State:
    def carry(self, extra):
        self.extra = extra


def test_an_old_checkpoint_with_a_pickled_strategy_resumes_its_attributes(tmp_path):
    """Formats 1-2 pickled strategies without state_dict (protocols 0-5), format 3 a wrapped one: read as data,
    their plain attributes go to the strategy the config builds."""
    from fedsim.strategies.fedavg import FedAvg

    old = FedAvg(fraction_evaluate=0.0)
    old.rounds = 7  # a user's subclass would count like this
    for proto in range(6):
        data = pickle.dumps(old, protocol=proto)
        torch.save(_plain_checkpoint(format=2, strategy_pickle=data), tmp_path / "old.pt")
        fresh = FedAvg()
        restored = checkpoint.restore(checkpoint.load(tmp_path / "old.pt"), _State(), fresh)
        assert restored is fresh and fresh.rounds == 7 and fresh.fraction_evaluate == 0.0, proto
    fmt1 = pickle.dumps(old, protocol=2).replace(b"fedsim.strategies.fedavg", b"strategies.fedavg")
    torch.save(_plain_checkpoint(format=1, strategy_pickle=fmt1), tmp_path / "f1.pt")
    fresh = FedAvg()
    checkpoint.restore(checkpoint.load(tmp_path / "f1.pt"), _State(), fresh)
    assert fresh.rounds == 7


def test_resume_below_the_checkpoints_round_is_refused():
    with pytest.raises(ConfigError, match=r"^num_rounds=3 is not allowed: expected an integer >= 5"):
        checkpoint.check_rounds({"round": 5}, 3, "run/checkpoint.pt")
    checkpoint.check_rounds({"round": 5}, 5, "run/checkpoint.pt")


# ------------------------------------------------------------------------------ foreign replies (item 12)
def _reply(content, node=7):
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict
    from strategy_helpers import server_identity

    with server_identity():
        msg = Message(RecordDict({"config": ConfigRecord({})}), node, MessageType.TRAIN)
    msg.metadata.__dict__["_message_id"] = f"m{node}"
    return Message(content, reply_to=msg)


def test_foreign_or_malformed_replies_are_counted_failures_naming_what_is_missing():
    from flwr.app import MetricRecord, RecordDict
    from strategy_helpers import record

    from fedsim.grid_utils import screen_replies

    f32 = np.float32
    ref = record({"fc.weight": np.zeros((2, 3), f32), "fc.bias": np.zeros(2, f32)})
    ok_metrics = MetricRecord({"num-examples": 10, "partition-id": 1, "train-loss": 0.5})
    float64 = record({"fc.weight": np.zeros((2, 3)), "fc.bias": np.zeros(2, f32)})
    renamed = record({"layer.0.weight": np.zeros((2, 3), f32)})
    replies = [
        _reply(RecordDict({"arrays": ref, "metrics": MetricRecord({"num-examples": 10})})),  # not fedsim's
        _reply(RecordDict({"arrays": ref})),
        _reply(RecordDict({"arrays": renamed, "metrics": ok_metrics})),
        _reply(RecordDict({"arrays": float64, "metrics": ok_metrics})),
        _reply(RecordDict({"arrays": ref, "metrics": ok_metrics})),
    ]
    valid, failures = screen_replies(replies, ref)
    assert len(valid) == 1
    kinds = [k for k, _ in failures]
    assert kinds == ["malformed", "malformed", "shape", "dtype"]
    assert "'partition-id'" in failures[0][1] and "node 7" in failures[0][1]
    assert "MetricRecord 'metrics'" in failures[1][1]
    assert (
        "missing 'fc.bias', 'fc.weight'" in failures[2][1] and "unexpected 'layer.0.weight'" in failures[2][1]
    )
    assert "'fc.weight' is float64" in failures[3][1]


# ------------------------------------------------------------------------------------------ BLAS (item 11)
def test_server_side_synthetic_data_is_built_with_one_blas_thread(monkeypatch):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from fedsim.data import synthetic as mod

    seen = []
    real = mod._generate

    def spy(*args, **kwargs):
        seen.extend(i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas")
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "_generate", spy)
    ds = mod.synthetic(seed=0, num_users=2, dim=4)
    assert ds.x_train.shape[1] == 4 and seen and set(seen) == {1}


# ====================================================================================== end to end (slow)
@pytest.mark.slow
def test_sigterm_leaves_outputs_that_resume_to_the_uninterrupted_result(tmp_path):
    """`kill -TERM` of `fedsim num_rounds=200 checkpoint_every=0`: checkpoint.pt, model.pt and summary.json
    (interrupted, exit 143); resuming gives the uninterrupted run's metrics and model bit for bit."""
    over = ["num_rounds=200", "checkpoint_every=0", "quiet=true"]
    full = fedsim_cli(*over, "hydra.run.dir=full", cwd=tmp_path)
    assert full.returncode == 0, full.stderr
    proc = fedsim_cli(*over, "hydra.run.dir=part", cwd=tmp_path, background=True)
    metrics = tmp_path / "part" / "metrics.jsonl"
    for _ in range(1200):
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 30:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "fedsim: interrupted by SIGTERM" in err
    part = tmp_path / "part"
    summary = json.loads((part / "summary.json").read_text())
    ckpt = torch.load(part / "checkpoint.pt", weights_only=False)
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM"
    assert 0 < summary["rounds_done"] == ckpt["round"] == read_metrics(part)[-1]["round"] < 200
    model = torch.load(part / "model.pt")
    assert all(torch.equal(model[k], ckpt["arrays"][k]) for k in model)
    assert _tmp_files(part) == []
    resumed = fedsim_cli(*over, "resume=part", "hydra.run.dir=resumed", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert without_wall_time(read_metrics(tmp_path / "resumed")) == without_wall_time(
        read_metrics(tmp_path / "full")
    )
    a, b = torch.load(tmp_path / "resumed" / "model.pt"), torch.load(tmp_path / "full" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_ctrl_c_exits_130_with_its_outputs(tmp_path):
    proc = fedsim_cli("num_rounds=200", "quiet=true", "hydra.run.dir=run", cwd=tmp_path, background=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    for _ in range(1200):
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGINT"


@pytest.mark.slow
def test_sigterm_on_the_ray_engine_is_an_interrupt_too(tmp_path):
    """Ray's driver replaced fedsim's SIGTERM handler (sys.exit(15): status failed, then an abort), and its
    ServerApp thread kept an interrupted process alive; now: interrupted, exit 143, the process ends."""
    over = [*TINY, "num_rounds=300", "engine=ray", "hydra.run.dir=run"]
    proc = fedsim_cli(*over, cwd=tmp_path, background=True, start_new_session=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    for _ in range(3000):
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 143, err[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM"
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert ckpt["round"] == summary["rounds_done"] == read_metrics(tmp_path / "run")[-1]["round"]


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child nobody has reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc")
def test_the_reaper_kills_what_a_dead_parent_left_and_nothing_else(tmp_path):
    """A parent that dies leaves a grandchild; the watcher it started kills that one, not an unrelated
    process, and a parent that stops its watcher leaves everything alone."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from fedsim.engines.reaper import Reaper\n"
        "reaper = Reaper()\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(2.5)  # the watcher notes the child\n"
        "if sys.argv[1] == 'stop':\n"
        "    reaper.stop()\n"
        "    sys.exit(0)\n"
        "time.sleep(60)\n"
    )
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    for mode in ("kill", "stop"):
        parent = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True)
        child = int(parent.stdout.readline())
        if mode == "kill":
            time.sleep(2.0)
            parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while mode == "kill" and _running(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = _running(child)
        assert alive == (mode == "stop"), mode
        if alive:
            os.kill(child, signal.SIGKILL)
    assert bystander.poll() is None  # not a descendant of the parent: untouched
    bystander.kill()
    bystander.wait()


def _ray_processes() -> set[int]:
    """Pids of Ray's processes on this machine (raylet, GCS, agents, workers)."""
    out = subprocess.run(
        ["pgrep", "-f", "ray::|raylet|gcs_server|default_worker"], capture_output=True, text=True
    ).stdout
    return {int(p) for p in out.split()}


@pytest.mark.slow
def test_a_sigkilled_ray_run_leaves_no_ray_process_behind_for_long(tmp_path):
    """SIGKILL cannot be handled: fedsim.engines.reaper, a watcher in its own session, kills what the run left
    (Ray's agents used to linger for two minutes, trying to reach the dead GCS)."""
    before = _ray_processes()
    over = [*TINY, "num_rounds=300", "engine=ray", "hydra.run.dir=run"]
    proc = fedsim_cli(*over, cwd=tmp_path, background=True, start_new_session=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    for _ in range(3000):
        if proc.poll() is not None or (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    ours = _ray_processes() - before
    assert ours  # the run's Ray processes
    proc.kill()  # SIGKILL the driver only, as the OOM killer would
    proc.communicate()
    deadline = time.monotonic() + 45
    while (_ray_processes() & ours) and time.monotonic() < deadline:
        time.sleep(1)
    left = _ray_processes() & ours
    for pid in left:  # (tidy up before failing)
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{len(left)} Ray process(es) still alive 45 s after the driver was killed"


@pytest.mark.slow
def test_a_second_run_aimed_at_a_live_runs_folder_is_refused_touching_nothing(tmp_path):
    # 5000 rounds: the first run is still live when the second starts, however fast the machine (150 rounds once
    # ended before the second command had imported), and is stopped below
    first = fedsim_cli("num_rounds=5000", "quiet=true", "hydra.run.dir=shared", cwd=tmp_path, background=True)
    run = tmp_path / "shared"
    for _ in range(1200):
        if (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 3:
            break
        time.sleep(0.05)
    before = {p.relative_to(run): p.read_bytes() for p in (run / ".hydra").iterdir()}
    second = fedsim_cli("num_rounds=2", "seed=5", "hydra.run.dir=shared", cwd=tmp_path)
    assert second.returncode == 2, second.stderr
    lines = [ln for ln in second.stderr.splitlines() if ln.startswith("fedsim:")]
    assert len(lines) == 1 and "no other live fedsim run is writing to" in lines[0]
    assert {p.relative_to(run): p.read_bytes() for p in (run / ".hydra").iterdir()} == before
    assert first.poll() is None  # untouched by the refused run, still training
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 143, err
    summary = json.loads((run / "summary.json").read_text())  # the first run's, not the refused one's
    assert summary["status"] == "interrupted" and summary["rounds_done"] >= 3
    assert summary["config"]["num_rounds"] == 5000 and summary["config"]["seed"] == 0
    rounds = [r["round"] for r in read_metrics(run)]
    assert rounds == list(range(summary["rounds_done"] + 1))  # every line whole, all the first run's


@pytest.mark.slow
def test_a_crafted_checkpoint_creates_no_file_when_resumed(tmp_path):
    marker = tmp_path / "created_by_checkpoint"
    torch.save(_plain_checkpoint(extra={"x": _Evil(marker)}), tmp_path / "checkpoint.pt")
    with pytest.raises(ConfigError, match=r"^resume=.*checkpoint\.pt"):
        run_tiny(tmp_path / "run", f"resume={tmp_path / 'checkpoint.pt'}")
    res = fedsim_cli(*TINY, f"resume={tmp_path / 'checkpoint.pt'}", "hydra.run.dir=cli", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert not marker.exists() and not (tmp_path / "cli" / ".hydra").exists()


@pytest.mark.slow
def test_ctrl_c_during_a_checkpoint_write_leaves_outputs_of_one_round(tmp_path, monkeypatch):
    real = torch.save
    writes = {"n": 0}

    def save(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and "format" in obj:
            writes["n"] += 1
            if writes["n"] == 3:  # round 3's checkpoint: Ctrl-C arrives in the middle of the write
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    summary = run_tiny(tmp_path, "num_rounds=5", "checkpoint_every=1")
    monkeypatch.setattr(torch, "save", real)
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == on_disk["status"] == "interrupted"
    assert on_disk["rounds_done"] == ckpt["round"] == read_metrics(tmp_path)[-1]["round"] == 2
    model = torch.load(tmp_path / "model.pt")
    assert all(torch.equal(model[k], ckpt["arrays"][k]) for k in model)
    assert _tmp_files(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("quiet", ["true", "false"])
def test_a_diverging_model_fails_with_the_reason_keeping_the_last_finite_one(tmp_path, quiet):
    with pytest.raises(RunError, match="no longer finite after round 1") as err:
        run_tiny(tmp_path, "strategy=fedavgm", "strategy.server_learning_rate=1e30", f"quiet={quiet}")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == str(err.value)
    assert all(torch.isfinite(v).all() for v in torch.load(tmp_path / "model.pt").values())


@pytest.mark.slow
@pytest.mark.parametrize(
    "over",
    [
        ["heterogeneity.deadline=1e-9"],
        [
            "faults=mixed",
            "faults.error=0.5",
            "faults.dtype=0.5",
            "faults.nan=0",
            "faults.shape=0",
            "faults.timeout=0",
        ],
        ["heterogeneity=lognormal", "heterogeneity.dropout_prob=1.0"],
    ],
    ids=["deadline", "faults_sum_to_1", "dropouts"],
)
def test_a_run_that_aggregated_nothing_fails(tmp_path, over):
    with pytest.raises(RunError, match="no round aggregated an update: all 2 round"):
        run_tiny(tmp_path, *over)
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


@pytest.mark.slow
def test_replies_without_a_partition_id_count_for_their_node(tmp_path, monkeypatch):
    """A reply that does not say its partition (a stock Flower ClientApp's) is its node's partition; it used to be
    a bare KeyError, then a malformed-reply failure."""
    from flwr.app import MetricRecord

    import fedsim.client_app as ca

    real = ca.train_reply

    def foreign(*args, **kwargs):
        rep = real(*args, **kwargs)
        metrics = rep.content["metrics"]
        rep.content["metrics"] = MetricRecord({k: v for k, v in metrics.items() if k != "partition-id"})
        return rep

    monkeypatch.setattr(ca, "train_reply", foreign)
    summary = run_tiny(tmp_path / "foreign", "engine=inprocess")
    monkeypatch.undo()
    run_tiny(tmp_path / "own", "engine=inprocess")
    assert summary["status"] == "completed"
    a, b = read_metrics(tmp_path / "foreign"), read_metrics(tmp_path / "own")
    drop = lambda recs: [{k: v for k, v in r.items() if k != "bytes_up"} for r in without_wall_time(recs)]
    assert drop(a) == drop(b)  # each reply counted for its node's partition (bytes_up: no partition-id sent)


@pytest.mark.slow
def test_a_failed_plot_is_a_warning_and_a_failed_model_write_fails_the_run(tmp_path, monkeypatch):
    import fedsim.recorder as recorder

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    import fedsim.run as run_mod

    monkeypatch.setattr(run_mod, "start_figures", lambda: None)  # the pictures drawn in the run's process
    monkeypatch.setattr(recorder, "plot_curves", no_space)
    summary = run_tiny(tmp_path / "plot")
    assert summary["status"] == "completed" and (tmp_path / "plot" / "summary.json").exists()
    assert not (tmp_path / "plot" / "curves.png").exists()
    real = recorder.atomic_torch_save

    def model_fails(obj, path):
        if Path(path).name == "model.pt":
            raise recorder.write_error(path, OSError(errno.ENOSPC, "No space left on device"))
        return real(obj, path)

    monkeypatch.setattr(run_mod, "atomic_torch_save", model_fails)
    with pytest.raises(RunError, match=r"cannot write .*model\.pt: the disk is full"):
        run_tiny(tmp_path / "model")
    summary = json.loads((tmp_path / "model" / "summary.json").read_text())
    assert summary["status"] == "failed" and "model.pt" in summary["error"]


@pytest.mark.slow
def test_a_full_disk_mid_run_is_one_line_and_the_summary_is_written(tmp_path):
    """A file-size limit stands in for a full disk: checkpoint.pt (60 kB) cannot be written at round 2."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))

    res = fedsim_cli(
        *TINY,
        "num_rounds=4",
        "checkpoint_every=2",
        "model.hidden=[200]",
        "hydra.run.dir=run",
        cwd=tmp_path,
        preexec_fn=limit,
    )
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    failed = [ln for ln in res.stderr.splitlines() if ln.startswith("fedsim: run failed:")]
    assert len(failed) == 1 and "checkpoint.pt: File too large" in failed[0]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rounds_done"] == 1
    assert [r["round"] for r in read_metrics(tmp_path / "run")] == [0, 1]
    assert _tmp_files(tmp_path / "run") == []


@pytest.mark.slow
def test_bad_input_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    cases = [
        (["quiet=maybe"], "quiet='maybe' is not allowed: expected true or false"),
        (["stop_at_target=no"], "stop_at_target='no' is not allowed: expected true or false"),
        (["strategy=null"], "strategy=null is not allowed: expected one of"),
        (["seed=18446744073709551616"], "seed=18446744073709551616 is not allowed"),
        (["hydra.run.dir=a_file"], "hydra.run.dir='a_file' is not allowed"),
        (["client.lr=inf"], "client.lr=inf is not allowed"),
    ]
    for over, needle in cases:
        res = fedsim_cli(*TINY, *over, cwd=tmp_path)
        lines = [ln for ln in res.stderr.splitlines() if ln.startswith("fedsim:")]
        assert res.returncode == 2 and "Traceback" not in res.stderr, (over, res.stderr)
        assert len(lines) == 1 and needle in lines[0], (over, res.stderr)
    assert not list(tmp_path.rglob(".hydra"))  # a refused run leaves no run folder behind


@pytest.mark.slow
def test_a_config_error_in_a_reused_folder_keeps_its_hydra_files(tmp_path):
    assert fedsim_cli(*TINY, "hydra.run.dir=run", cwd=tmp_path).returncode == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "run" / ".hydra").iterdir()}
    res = fedsim_cli(*TINY, "clients_per_round=30", "hydra.run.dir=run", cwd=tmp_path)
    assert res.returncode == 2 and "clients_per_round=30 is not allowed" in res.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "run" / ".hydra").iterdir()} == before


@pytest.mark.slow
def test_a_refused_in_place_resume_touches_nothing_and_too_few_rounds_are_refused(tmp_path):
    first = fedsim_cli(*TINY, "num_rounds=3", "checkpoint_every=1", "hydra.run.dir=run", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    overrides = (tmp_path / "run" / ".hydra" / "overrides.yaml").read_bytes()
    files = {p.name: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    res = fedsim_cli(*TINY, "num_rounds=5", "client.lr=0.5", "resume=run", "hydra.run.dir=run", cwd=tmp_path)
    assert res.returncode == 2 and "client.lr (checkpoint: 0.1, now: 0.5)" in res.stderr
    assert (tmp_path / "run" / ".hydra" / "overrides.yaml").read_bytes() == overrides
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == files
    res = fedsim_cli(*TINY, "num_rounds=2", "resume=run", "hydra.run.dir=other", cwd=tmp_path)
    assert res.returncode == 2 and "num_rounds=2 is not allowed: expected an integer >= 3" in res.stderr
    assert not (tmp_path / "other").exists()
    ok = fedsim_cli(
        *TINY, "num_rounds=4", "checkpoint_every=0", "resume=run", "hydra.run.dir=run", cwd=tmp_path
    )
    assert ok.returncode == 0, ok.stderr  # in place: the checkpoint is replaced by one of round 4
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["round"] == 4


@pytest.mark.slow
def test_joblib_sweeps_exit_non_zero_on_a_failed_job_and_summarise_only_their_jobs(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    import csv

    common = ["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *TINY, "num_rounds=1"]
    res = fedsim_cli(*common, "clients_per_round=2,7,3", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert res.returncode == 1 and "1 run(s) of the sweep failed" in res.stderr, res.stderr
    res = fedsim_cli(*common, "clients_per_round=2", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    with open(tmp_path / "sweep" / "sweep_summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["status"]) for r in rows] == [("0", "completed")]


@pytest.mark.slow
@pytest.mark.parametrize(
    "over",
    [
        ["strategy=fedavg"],
        ["strategy=fedavgm"],
        [
            "strategy=fedadam",
            "clipping=adaptive",
            "clipping.noise_multiplier=0.5",
            "clipping.noise_seed=3",
            "clipping.debug_noise_seed=true",
        ],
        ["strategy=fedavg", "clipping=fixed"],
        ["strategy=krum", "clients_per_round=5", "strategy.num_malicious=0"],
        ["strategy=fedbuff"],
    ],
    ids=lambda o: "-".join(x.split("=")[1] for x in o[:2]),
)
def test_every_strategys_checkpoint_is_plain_data_and_resumes(tmp_path, over):
    run_tiny(tmp_path / "a", *over, "checkpoint_every=1")
    names = torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "a" / "checkpoint.pt")
    assert all(n.startswith("numpy") for n in names), names  # numpy arrays only: allowed explicitly
    ckpt = checkpoint.load(tmp_path / "a")
    assert ckpt["format"] == checkpoint.FORMAT and ckpt["strategy_pickle"] is None
    assert run_tiny(tmp_path / "b", *over, "num_rounds=3", f"resume={tmp_path / 'a'}")["rounds_done"] == 3


# ------------------------------------------------------------------ garbled replies (issue 28, items 3-4)
def _garbled_cases():
    """One reply per kind of damage (all from node 7, which holds partition 1): the kind, the reply's content,
    and a phrase its failure names."""
    from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
    from strategy_helpers import record

    f32 = np.float32
    good = {"fc.weight": np.ones((2, 3), f32), "fc.bias": np.ones(2, f32)}
    ok = {"num-examples": 10, "partition-id": 1, "train-loss": 0.5}

    def with_array(**array):
        arrays = {k: Array(v) for k, v in good.items()}
        arrays["fc.bias"] = Array(**array)
        return RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord(ok)})

    def with_metrics(**m):
        return RecordDict({"arrays": record(good), "metrics": MetricRecord({**ok, **m})})

    bias = Array(np.ones(2, f32))
    rng = np.random.default_rng(0)
    return {
        "extra metric key": (with_metrics(**{"surprise": 1.0}), "extra metrics 'surprise'"),
        "random bytes": (
            with_array(dtype="float32", shape=(2,), stype="numpy.ndarray", data=rng.bytes(40)),
            "are not a numpy array",
        ),
        "truncated bytes": (
            with_array(dtype="float32", shape=(2,), stype="numpy.ndarray", data=bias.data[:-3]),
            "hold 5 bytes of values",
        ),
        "bytes unlike metadata": (
            with_array(dtype="float32", shape=(2,), stype="numpy.ndarray", data=Array(np.ones(2)).data),
            "are float64 (2,), but it declares float32 (2,)",
        ),
        "not numpy": (
            with_array(dtype="float32", shape=(2,), stype="torch.Tensor", data=bias.data),
            "'torch.Tensor' array, not a numpy array",
        ),
        "absurd num-examples": (with_metrics(**{"num-examples": 1e308}), "num-examples 1e+308"),
        "fractional num-examples": (with_metrics(**{"num-examples": 2.5}), "num-examples 2.5"),
        "unknown partition": (
            with_metrics(**{"partition-id": 999}),
            "partition-id 999, but the node holds partition 1",
        ),
        "fractional partition": (with_metrics(**{"partition-id": 2.5}), "partition-id 2.5 is not a whole"),
        "huge partition": (with_metrics(**{"partition-id": 1e300}), "partition-id 1e+300 is not a whole"),
    }


@pytest.mark.parametrize("kind", list(_garbled_cases()))
def test_a_garbled_reply_is_dropped_naming_node_and_reason_and_the_round_aggregates(kind):
    """Each kind of damage in one reply among good ones: that reply is a ``malformed`` failure naming node 7
    and the reason; FedAvg aggregates the rest (before screening, these replies crashed it or turned the
    model to zeros)."""
    from flwr.app import MetricRecord, RecordDict
    from strategy_helpers import record

    from fedsim.grid_utils import screen_replies
    from fedsim.strategies.fedavg import FedAvg

    content, phrase = _garbled_cases()[kind]
    good = {"fc.weight": np.ones((2, 3), np.float32), "fc.bias": np.ones(2, np.float32)}
    replies = [_reply(content, node=7)]
    for node, pid in ((8, 2), (9, 3)):
        m = MetricRecord({"num-examples": 10, "partition-id": pid, "train-loss": 0.5})
        replies.append(_reply(RecordDict({"arrays": record(good), "metrics": m}), node=node))
    valid, failures = screen_replies(replies, record(good), {7: 1, 8: 2, 9: 3})
    assert [r.metadata.src_node_id for r in valid] == [8, 9]
    assert len(failures) == 1 and failures[0][0] == "malformed"
    assert "node 7" in failures[0][1] and phrase in failures[0][1], failures[0][1]
    arrays, _ = FedAvg().aggregate_train(1, valid)
    assert np.allclose(arrays["fc.bias"].numpy(), 1.0)


def test_duplicate_partitions_unknown_nodes_and_all_zero_examples_are_dropped():
    from flwr.app import MetricRecord, RecordDict
    from strategy_helpers import record

    from fedsim.grid_utils import screen_replies

    good = record({"w": np.ones(2, np.float32)})

    def rep(node, pid, n=10):
        m = MetricRecord({"num-examples": n, "partition-id": pid})
        return _reply(RecordDict({"arrays": good, "metrics": m}), node=node)

    valid, failures = screen_replies([rep(7, 1), rep(8, 1)], good)  # no discovery map: two claim partition 1
    assert len(valid) == 1 and "partition-id 1 is node 7's reply's too" in failures[0][1]
    valid, failures = screen_replies([rep(7, 1), rep(5, 4)], good, {7: 1, 8: 2})
    assert len(valid) == 1 and "node 5, which is not one of the run's clients" in failures[0][1]
    valid, failures = screen_replies([rep(7, 1, 0), rep(8, 2, 0)], good, {7: 1, 8: 2})
    assert valid == [] and len(failures) == 2 and "num-examples is 0 in every reply" in failures[0][1]
    valid, failures = screen_replies([rep(7, 1, 0), rep(8, 2, 5)], good, {7: 1, 8: 2})
    assert len(valid) == 2 and failures == []  # one empty client among others weighs 0, as FedAvg says


@pytest.mark.slow
def test_a_run_with_a_garbled_reply_every_round_goes_on_and_counts_it(tmp_path, monkeypatch):
    """In the loop: one reply per round gets an extra metric key and bytes unlike its metadata; the round
    aggregates the others and metrics.jsonl counts the failure. (The replies are Messages here, engine=inprocess;
    tests/test_stacked.py garbles the same replies on every engine's path.)"""
    from flwr.app import MetricRecord

    import fedsim.server as server

    original = server.screen_replies

    def garble(replies, *rest):
        replies = list(replies)
        first = replies[0].content
        first["metrics"] = MetricRecord({**dict(first["metrics"].items()), "surprise": 1.0})
        return original(replies, *rest)

    monkeypatch.setattr(server, "screen_replies", garble)
    summary = run_tiny(tmp_path, "num_rounds=2", "engine=inprocess")
    recs = read_metrics(tmp_path)[1:]
    assert summary["status"] == "completed"
    assert [r["failures"] for r in recs] == [1, 1] and [r["num_clients"] for r in recs] == [2, 2]
    assert all(r["failure_kinds"] == {"malformed": 1} for r in recs)


# --------------------------------------------------------------------- damaged data files (issue 28, item 7)
def _npz_files(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    x = rng.random((60, 4), dtype=np.float32)
    np.savez(folder / "good.npz", x=x, y=np.arange(60) % 3)
    np.savez(folder / "huge_label.npz", x=x, y=np.r_[np.arange(59) % 3, 10**6])
    data = (folder / "good.npz").read_bytes()
    (folder / "empty.npz").write_bytes(b"")
    (folder / "truncated.npz").write_bytes(data[: len(data) // 2])
    (folder / "random.npz").write_bytes(rng.bytes(3000))
    return {p.stem: p for p in folder.iterdir()}


def test_a_damaged_or_absurd_npz_is_one_line_naming_it(tmp_path):
    from fedsim.data.base import MAX_CLASSES, Dataset
    from fedsim.data.npz import load_npz

    files = _npz_files(tmp_path)
    for name in ("empty", "truncated", "random"):
        with pytest.raises(ConfigError, match=rf"^path='.*{name}\.npz' .*damaged or not an \.npz file") as e:
            load_npz(0, str(files[name]))
        assert "allow_pickle" not in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^num_classes=None .*4 distinct labels but label 1000000"):
        load_npz(0, str(files["huge_label"]))
    assert load_npz(0, str(files["good"])).num_classes == 3
    y = np.zeros(4, np.int64)
    with pytest.raises(ConfigError, match=rf"1 to {MAX_CLASSES} classes"):
        Dataset("d", np.zeros((4, 2), np.float32), y, np.zeros((4, 2), np.float32), y, 10**6, (2,))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["empty", "truncated", "random", "huge_label"])
def test_a_damaged_data_file_on_the_command_line_is_one_line_and_no_folder(tmp_path, name):
    files = _npz_files(tmp_path / "data")
    res = fedsim_cli(*TINY, "dataset=npz", f"dataset.path={files[name]}", "hydra.run.dir=run", cwd=tmp_path)
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("fedsim:")]
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(lines) == 1, res.stderr[-2000:]
    assert name in lines[0] or "num_classes" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_picture_process_ends_when_the_run_is_killed(tmp_path):
    """The worker that draws partitions.png and curves.png never outlives its run, even one killed with
    SIGKILL (it once kept drawing at 20 GB after its run was gone)."""
    code = (
        "from fedsim.figures import FigureWorker; w = FigureWorker(); print(w.proc.pid, flush=True); input()"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    worker = int(parent.stdout.readline())
    assert _running(worker)
    parent.kill()
    parent.wait()
    end = time.monotonic() + 20
    while _running(worker) and time.monotonic() < end:
        time.sleep(0.1)
    assert not _running(worker)


def test_a_long_title_fits_the_curves_picture(tmp_path):
    """curves.png's title (the run's choices) is wrapped inside the figure, not cut at both edges."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedsim.figures import plot_curves

    title = " ".join(f"group{i}=option_with_a_long_name_{i}" for i in range(12))
    records = [
        {"round": r, "sim_time": float(r), "eval_loss": 1.0 / (r + 1), "eval_accuracy": r / 10}
        for r in range(4)
    ]
    captured = {}
    real_savefig = plt.Figure.savefig

    def savefig(fig, *args, **kwargs):
        real_savefig(fig, *args, **kwargs)
        renderer = fig.canvas.get_renderer()
        captured["box"] = fig._suptitle.get_window_extent(renderer)
        captured["width"] = fig.bbox.width

    plt.Figure.savefig = savefig
    try:
        plot_curves(records, tmp_path / "curves.png", title)
    finally:
        plt.Figure.savefig = real_savefig
    assert captured["box"].x0 >= 0 and captured["box"].x1 <= captured["width"]
    assert (tmp_path / "curves.png").stat().st_size > 0


# ------------------------------------------------------------------------ the small ones (issue 28, item 8)
@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.3, 0.6, 1.0, 1.5, 2.5])
def test_a_signal_while_the_command_starts_is_a_clean_exit_143(tmp_path, delay):
    """SIGTERM while fedsim imports, checks the config or builds the run (from 0.3 s: the interpreter's own
    start-up comes first): exit 143, one line, no traceback,
    and no folder holding only Hydra's files (a run folder with outputs has its summary.json). 5000 rounds: the
    run is never over before the signal, however fast the machine."""
    proc = fedsim_cli(*TINY, "num_rounds=5000", "hydra.run.dir=run", cwd=tmp_path, background=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGTERM)
    try:  # the command's signal state when the signal was sent (blocked, ignored, caught, pending), for a failure
        state = [
            ln
            for ln in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
            if ln.startswith(("Sig", "ShdPnd"))
        ]
    except OSError:
        state = []
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143 and "Traceback" not in err, (err[-3000:], state)
    run = tmp_path / "run"
    assert not run.exists() or (run / "summary.json").exists(), sorted(p.name for p in run.iterdir())


class SignalInAFinaliser(Callback):
    """A callback that, after round 2, drops an object whose ``__del__`` is where SIGTERM's handler runs (as a
    finaliser the garbage collector calls at any allocation can be)."""

    def on_round(self, record):
        if record["round"] == 2:
            from fedsim import errors

            class Dropped:
                def __del__(self):
                    os.kill(os.getpid(), signal.SIGTERM)
                    deadline = time.monotonic() + 5
                    while errors._GUARD.first is None and time.monotonic() < deadline:
                        pass  # the handler runs here: its Interrupted ends this __del__, and Python swallows it

            Dropped()


def test_a_signal_a_finaliser_swallows_still_ends_the_run(tmp_path, capfd):
    """The Interrupted raised inside a ``__del__`` never reaches the loop (Python prints "Exception ignored
    in" and goes on): the run still ends interrupted at the end of that round, with its outputs, and prints no
    traceback. Before, it ran to its end, completed (the start-signal test's rare exit 0)."""
    handler, hook = signal.getsignal(signal.SIGTERM), sys.unraisablehook
    summary = run_tiny(
        tmp_path,
        "num_rounds=50",
        "checkpoint_every=0",
        "callbacks=[{_target_: test_reliability.SignalInAFinaliser}]",
    )
    err = capfd.readouterr().err
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM", summary
    # as a signal raised at once during round 2 (its recording included): rolled back to the end of round 1
    assert summary["rounds_done"] == 1 and [r["round"] for r in read_metrics(tmp_path)] == [0, 1]
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["round"] == 1
    assert "Exception ignored" not in err and "Traceback" not in err, err
    # the guard gave the signal handler and Python's unraisable hook back
    assert signal.getsignal(signal.SIGTERM) is handler and sys.unraisablehook is hook


def test_zero_attackers_warn_and_absurd_thread_counts_are_refused(caplog):
    from fedsim.features.attacks.server import SignFlip
    from fedsim.groups import Placement
    from fedsim.strategies.fedavg import FedAvg

    with caplog.at_level("WARNING", logger="fedsim"):
        SignFlip(strategy=FedAvg(), fraction=0.01, num_clients=10, clients_per_round=5, seed=0)
    assert "is 0 attackers; the run is not attacked" in caplog.text
    with pytest.raises(
        ConfigError, match=r"^threads_per_client=1000 is not allowed: expected an integer in \[1, 256\]"
    ):
        Placement(threads_per_client=1000)
    assert Placement(threads_per_client=8).threads_per_client == 8


# ------------------------------------------------------- a run that stops training does not claim success (issue 39)
def _savez_fails_after(monkeypatch, calls: int) -> None:
    """Client-state writes fail with EACCES after ``calls`` of them, as in a ``client_state/`` made read-only."""
    from fedsim.algorithms import state as cs

    real, n = cs.np.savez, [0]

    def savez(f, *args, **kwargs):
        n[0] += 1
        if n[0] > calls:
            raise PermissionError(13, "Permission denied", str(f))
        return real(f, *args, **kwargs)

    monkeypatch.setattr(cs.np, "savez", savez)


def test_client_state_that_cannot_be_written_fails_the_run_not_a_client(tmp_path, monkeypatch):
    """SCAFFOLD whose client_state/ stops taking writes in round 4: not 3 client failures a round and the
    rounds after it skipped, ending `completed`; the run fails there in one line naming the file, with the
    outputs of the 3 rounds done."""
    _savez_fails_after(monkeypatch, 9)  # 3 clients a round: rounds 1-3 write
    with pytest.raises(
        RunError,
        match=r"^round 4: client state .*client_state/\d+-4\.npz cannot be written \(Permission denied\)$",
    ):
        run_tiny(tmp_path, "strategy=scaffold", "num_rounds=8", "checkpoint_every=0")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rounds_done"] == 3 and summary["total_failures"] == 0
    assert "cannot be written" in summary["error"]


def test_rounds_in_which_every_client_fails_end_the_run_failed(tmp_path, monkeypatch):
    """Rounds 1-2 train; from round 3 every client's reply is an error: after max_failed_rounds=3 such rounds
    the run stops (round 5), `failed`, the reason in one line; the rounds before it stay in the outputs."""
    import fedsim.server as server
    from fedsim.messages import Cohort

    original, calls = server._train_replies, [0]

    def fail_from_round_3(*args):
        calls[0] += 1
        if calls[0] < 3:
            return original(*args)
        return 0, Cohort.from_replies([]), [("error", "<class 'ValueError'>:<'boom'>")] * len(args[2])

    monkeypatch.setattr(server, "_train_replies", fail_from_round_3)
    with pytest.raises(
        RunError, match=r"^every client failed in 3 consecutive rounds \(3-5; error: 9\), max_failed_rounds=3"
    ):
        run_tiny(tmp_path, "num_rounds=20", "max_failed_rounds=3", "checkpoint_every=0")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rounds_done"] == 5
    assert [r["num_clients"] for r in read_metrics(tmp_path)[1:]] == [3, 3, 0, 0, 0]
    assert (
        torch.load(tmp_path / "checkpoint.pt", weights_only=False)["round"] == 5
    )  # resumable where it ended
    calls[0] = 0  # the same failures with the check off (0): the run goes on to its last round
    assert run_tiny(tmp_path / "off", "num_rounds=6", "max_failed_rounds=0")["rounds_done"] == 6


def test_max_failed_rounds_takes_integers_from_0():
    for bad, shown in (("-1", "-1"), ("1.5", "1.5"), ("x", "'x'")):
        with pytest.raises(
            ConfigError,
            match=rf"^max_failed_rounds={re.escape(shown)} is not allowed: expected an integer >= 0",
        ):
            validate(compose_cfg(f"max_failed_rounds={bad}"))
    validate(compose_cfg("max_failed_rounds=0"))
