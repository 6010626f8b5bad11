"""A resume checks everything before it adopts anything (issue 39, findings 2 and 4), and checkpoint.pt keeps
the metrics history's count and digest instead of the history (issue 41, item 2)."""

from __future__ import annotations

import io
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY, fedsim_cli, read_metrics, run_tiny

from fedsim import checkpoint
from fedsim.algorithms import state as cs
from fedsim.errors import ConfigError


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------- the clients' state, by content (finding 2)
def _npz(**arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _damage(path: Path, kind: str) -> None:
    """Damage one client-state file the ways an unlucky disk or a crafted folder would."""
    good = path.read_bytes()
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    name = next(iter(arrays))
    c = arrays[name]
    damaged = {
        "truncated": lambda: good[: len(good) // 2],
        "random": lambda: np.random.default_rng(0).bytes(len(good)),
        "object": lambda: _npz(**{**arrays, name: np.array([{"a": 1}, None], dtype=object)}),
        "shape": lambda: _npz(**{**arrays, name: np.zeros(c.size + 3, c.dtype)}),
        "nan": lambda: _npz(**{**arrays, name: np.full_like(c, np.nan)}),
        "no_arrays": lambda: _npz(),
    }[kind]()
    path.write_bytes(damaged)


KINDS = ["truncated", "random", "object", "shape", "nan", "no_arrays"]


def _snapshot(tmp_path: Path) -> tuple[Path, dict]:
    run = tmp_path / "run"
    (run / cs.STATE_DIR).mkdir(parents=True)
    for pid in range(3):
        np.savez(run / cs.STATE_DIR / f"{pid}-2.npz", c=np.arange(4.0) + pid)
    return run, cs.checkpoint(run, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_client_state_file_is_refused_naming_it_and_nothing_is_adopted(tmp_path, kind):
    """Each damage of one file of checkpoint_state/round-2/ is refused naming that file: against the sha256 the
    checkpoint recorded, and by content where an older checkpoint recorded none; the resumed folder's
    client_state/ is neither created nor changed."""
    run, rec = _snapshot(tmp_path)
    assert set(rec["sha256"]) == set(rec["files"]) == {"0-2.npz", "1-2.npz", "2-2.npz"}
    _damage(run / cs.CHECKPOINT_DIR / "round-2" / "1-2.npz", kind)
    target = tmp_path / "resumed"
    (target / cs.STATE_DIR).mkdir(parents=True)
    (target / cs.STATE_DIR / "0-1.npz").write_bytes(b"what was there")
    before = _files(target)
    with pytest.raises(
        cs.DamagedState, match=r"^checkpoint_state/round-2/1-2\.npz differs from the checkpoint"
    ):
        cs.resume(run, 2, target, rec)
    older = {"round": 2, "files": rec["files"]}  # a format-4 record: no digests, checked by content
    why = {
        "truncated": "is not a readable npz",
        "random": "is not a readable npz",
        "object": "is not a readable npz",  # loading it would unpickle: refused unread
        "shape": r"holds c of shape \[7\], other clients' \[4\]",
        "nan": "holds NaN or Inf in c",
        "no_arrays": "holds no arrays",
    }[kind]
    with pytest.raises(cs.DamagedState, match=rf"^checkpoint_state/round-2/1-2\.npz {why}"):
        cs.resume(run, 2, target, older)
    assert _files(target) == before  # nothing adopted, nothing removed
    assert not (target / (cs.STATE_DIR + ".restoring")).exists()


def test_a_whole_snapshot_is_adopted_byte_for_byte(tmp_path):
    run, rec = _snapshot(tmp_path)
    cs.resume(run, 2, tmp_path / "resumed", rec)
    assert _files(tmp_path / "resumed" / cs.STATE_DIR) == _files(run / cs.CHECKPOINT_DIR / "round-2")
    cs.resume(run, 2, tmp_path / "older", {"round": 2, "files": rec["files"]})  # content checks pass too


def test_a_damaged_client_state_file_refuses_the_whole_resume_of_a_scaffold_run(tmp_path):
    """End to end: SCAFFOLD checkpointed at round 2, one control-variate file truncated: the in-place resume is
    one line naming the file, and the run folder keeps every byte."""
    run = tmp_path / "run"
    over = ["strategy=scaffold", "checkpoint_every=2"]
    run_tiny(run, *over)
    snap = sorted((run / cs.CHECKPOINT_DIR / "round-2").iterdir())
    _damage(snap[0], "truncated")
    before = _files(run)
    with pytest.raises(ConfigError, match=rf"^resume=.*{snap[0].name} differs from the checkpoint") as e:
        run_tiny(run, *over, "num_rounds=4", f"resume={run}")
    assert "\n" not in str(e.value) and "no client's state was adopted" in str(e.value)
    assert _files(run) == before


# ------------------------------------------------- every field checked before anything is rewritten (finding 4)
@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory) -> Path:
    """A FedAvg run of 2 rounds with a checkpoint after each."""
    run = tmp_path_factory.mktemp("ckpt") / "run"
    run_tiny(run, "checkpoint_every=1")
    return run


def _crafted(ckpt: dict, run: Path, kind: str) -> None:
    """Change one field of ``ckpt`` (or metrics.jsonl beside it) the way a crafted or damaged file would."""
    first = next(iter(ckpt["arrays"]))
    if kind == "bytes_in_records":  # a format-4 checkpoint, which held its records
        ckpt.pop("history", None)
        ckpt["format"] = 4
        records = read_metrics(run)
        ckpt["records"] = [*records[:-1], {**records[-1], "note": b"\x00\x01"}]
    elif kind == "round_-5":
        ckpt["round"] = -5
    elif kind == "round_true":
        ckpt["round"] = True
    elif kind == "int64_arrays":
        ckpt["arrays"] = {k: v.to(torch.int64) for k, v in ckpt["arrays"].items()}
    elif kind == "nan_arrays":
        ckpt["arrays"][first] = torch.full_like(ckpt["arrays"][first], float("nan"))
    elif kind == "wrong_shape":
        ckpt["arrays"][first] = torch.zeros(3)
    elif kind == "sim_time_nan":
        ckpt["sim_time"] = float("nan")
    elif kind == "target_reached":
        ckpt["extra"] = {**ckpt["extra"], "target_reached": {"target": "x"}}
    elif kind == "history_count":
        ckpt["history"] = {**ckpt["history"], "count": 99}
    elif kind == "metrics_edited":
        text = (run / "metrics.jsonl").read_text().replace('"round": 1,', '"round": 1, "x": 1,')
        (run / "metrics.jsonl").write_text(text)
    elif kind == "metrics_gone":
        (run / "metrics.jsonl").unlink()
    elif kind == "client_file_path":
        ckpt["client_state"] = {"round": 2, "files": ["../../model.pt"]}
    elif kind == "strategy_attrs":
        ckpt["strategy_attrs"] = {"class": 5}


CRAFTED = [
    "bytes_in_records",
    "round_-5",
    "round_true",
    "int64_arrays",
    "nan_arrays",
    "wrong_shape",
    "sim_time_nan",
    "target_reached",
    "history_count",
    "metrics_edited",
    "metrics_gone",
    "client_file_path",
    "strategy_attrs",
]


@pytest.mark.parametrize("kind", CRAFTED)
def test_a_refused_in_place_resume_changes_no_file(tmp_path, checkpointed, kind):
    """A crafted or damaged checkpoint resumed in place: one line naming it, and every byte of the run folder
    (metrics.jsonl, summary.json, model.pt, checkpoint.pt, ...) as it was."""
    run = tmp_path / "run"
    shutil.copytree(checkpointed, run)
    ckpt = torch.load(run / "checkpoint.pt", weights_only=False)
    _crafted(ckpt, run, kind)
    torch.save(ckpt, run / "checkpoint.pt")
    before = _files(run)
    with pytest.raises(ConfigError, match=r"^resume=") as e:
        run_tiny(run, "checkpoint_every=1", "num_rounds=4", f"resume={run}")
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)
    assert _files(run) == before


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bytes_in_records", "round_-5", "int64_arrays"])
def test_the_command_refuses_a_crafted_checkpoint_in_one_line_changing_no_file(tmp_path, kind):
    """The issue's three cases through the command: exit 2, one line, no json TypeError, the folder's bytes
    as they were (``.fedsim.lock`` holds the PID of the last process that took the folder: left out)."""
    res = fedsim_cli(*TINY, "checkpoint_every=1", "hydra.run.dir=run", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    run = tmp_path / "run"
    ckpt = torch.load(run / "checkpoint.pt", weights_only=False)
    _crafted(ckpt, run, kind)
    torch.save(ckpt, run / "checkpoint.pt")
    before = {k: v for k, v in _files(run).items() if k != ".fedsim.lock"}
    res = fedsim_cli(
        *TINY, "num_rounds=4", "checkpoint_every=1", "resume=run", "hydra.run.dir=run", cwd=tmp_path
    )
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("fedsim: config error: resume="), (
        lines
    )
    assert "TypeError" not in res.stderr
    assert {k: v for k, v in _files(run).items() if k != ".fedsim.lock"} == before


# --------------------------------------------------------------- a checkpoint of O(model + state) (issue 41)
def _history_checkpoint(out: Path, rounds: int) -> int:
    from flwr.app import ArrayRecord

    from fedsim.recorder import Recorder
    from fedsim.state import RunState

    rec = Recorder(out, rounds, quiet=True)
    for r in range(rounds + 1):
        rec.log({"round": r, "eval_accuracy": 0.5 + r * 1e-6, "num_clients": 3, "failures": 0})
    state = RunState(arrays=ArrayRecord({"w": torch.zeros(4, 4)}), round=rounds)
    from fedsim.strategies.fedavg import FedAvg

    checkpoint.save(out / "checkpoint.pt", state, FedAvg(), rec.history(rounds), {"num_rounds": rounds})
    rec.close()
    return (out / "checkpoint.pt").stat().st_size


def test_the_checkpoint_keeps_the_historys_digest_not_the_history(tmp_path):
    """checkpoint.pt's size does not grow with the run (30 and 3,000 rounds: within a few bytes, the digits of
    the counts); its records come back from metrics.jsonl, equal to what was logged."""
    small = _history_checkpoint(tmp_path / "a", 30)
    big = _history_checkpoint(tmp_path / "b", 3000)
    assert abs(big - small) < 64, (small, big)
    with zipfile.ZipFile(tmp_path / "b" / "checkpoint.pt") as z:
        assert sum(i.file_size for i in z.infolist() if i.filename.endswith("data.pkl")) < 4000
    ckpt = checkpoint.load(tmp_path / "b")
    assert ckpt["records"] == read_metrics(tmp_path / "b") and len(ckpt["records"]) == 3001
    assert ckpt["history"] == checkpoint.fields.history_of(
        ckpt["records"]
    )  # the Recorder's digest: the lines'
    with open(
        tmp_path / "b" / "metrics.jsonl", "a"
    ) as f:  # lines a later round appended: not the checkpoint's
        f.write(json.dumps({"round": 3001}) + "\n")
    assert len(checkpoint.load(tmp_path / "b")["records"]) == 3001


def test_a_checkpoint_copied_without_its_metrics_is_refused_in_one_line(tmp_path, checkpointed):
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    shutil.copy(checkpointed / "checkpoint.pt", lonely)
    with pytest.raises(ConfigError, match=r"^resume=.*metrics\.jsonl beside it cannot be read") as e:
        checkpoint.load(lonely)
    assert "\n" not in str(e.value) and "copy metrics.jsonl with checkpoint.pt" in str(e.value)
    (lonely / "metrics.jsonl").write_text((checkpointed / "metrics.jsonl").read_text()[:-40])
    with pytest.raises(ConfigError, match=r"metrics\.jsonl beside it holds \d+ bytes, fewer than"):
        checkpoint.load(lonely)


@pytest.mark.slow
def test_the_checkpoint_size_bench_prints_one_size_from_30_to_10000_rounds():
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "bench" / "checkpoint_size.py"
    res = subprocess.run(
        [sys.executable, str(script), "--rounds", "30,10000", "--repeat", "1"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [line.split() for line in res.stdout.splitlines()[1:]]
    assert [r[0] for r in rows] == ["30", "10000"] and rows[0][1] == rows[1][1], res.stdout
