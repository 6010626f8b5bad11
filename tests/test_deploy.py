"""Deployment: fedsim's ServerApp and ClientApp on a real Flower SuperLink with three SuperNodes on 127.0.0.1.

The federation (TLS, SuperNode authentication, free ports) is started once for the module and stopped at the
end, checking that no process it started is left. Waiting is always polling for a condition with a generous
limit, never a fixed sleep. The first tests need no federation: packaging, commands and bad input.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from helpers import compose_cfg, read_metrics
from omegaconf import OmegaConf

from fedsim import build
from fedsim.deploy import (
    DeployError,
    Federation,
    Security,
    check_node,
    free_port,
    make_certs,
    make_node_key,
    superlink_command,
    supernode_command,
    wait_for_superlink,
)
from fedsim.deploy.launch import running
from fedsim.node_data import save_node_data
from fedsim.server_app import DeployConfigError, experiment_from


APP = Path(__file__).resolve().parents[1]  # the Flower App folder (pyproject.toml with [tool.flwr.app])
N = 3
# Tiny and fast: 60 features, an MLP, 3 clients all sampled every round.
TINY = ["dataset=synthetic", f"num_clients={N}", f"clients_per_round={N}", "quiet=true", "checkpoint_every=0"]
NODE2_TRAIN, NODE2_VAL = 23, 5  # node 2 trains on its own folder of this many examples

needs_flower = pytest.mark.skipif(
    shutil.which("flower-superlink") is None or shutil.which("flwr") is None,
    reason="Flower's deployment executables are not on PATH",
)


# ---- packaging: run_config overrides mean what the fedsim command line means ----------------------------


def test_overrides_compose_the_same_config_as_the_command_line():
    overrides = ["strategy=fedbuff", "num_rounds=5", "client.lr=0.05"]
    cfg, choices, _ = experiment_from({"overrides": shlex.join(overrides)})
    want = compose_cfg(*overrides)
    assert OmegaConf.to_container(cfg, resolve=True) == OmegaConf.to_container(want, resolve=True)
    assert choices["strategy"] == "fedbuff" and cfg.num_rounds == 5
    assert "hydra" not in cfg


def test_reply_log_names_the_node_a_superlink_error_reply_stands_for(tmp_path):
    """The SuperLink answers for a node it gave up on with its own node id; replies.jsonl names the node."""
    from flwr.app import Error, Message, Metadata, MetricRecord, RecordDict

    from fedsim import keys
    from fedsim.server_app import ReplyLog

    def message(src: int, dst: int, reply_to: str = "", content=None, error=None) -> Message:
        meta = Metadata(
            run_id=1,
            message_id="",
            src_node_id=src,
            dst_node_id=dst,
            reply_to_message_id=reply_to,
            group_id="1",
            message_type="train",
            created_at=time.time(),
            ttl=60,
        )
        return (
            Message(metadata=meta, error=error)
            if error is not None
            else Message(metadata=meta, content=content)
        )

    class FakeGrid:
        def __init__(self):
            self.sent = []

        def push_messages(self, messages):
            for i, m in enumerate(messages):
                m.metadata.__dict__["_message_id"] = f"m{len(self.sent) + i}"
            self.sent += messages
            return [m.metadata.message_id for m in messages]

        def pull_messages(self, ids):
            a, b = self.sent
            ok = RecordDict({keys.METRICS: MetricRecord({keys.PARTITION_ID: 4, keys.NUM_EXAMPLES: 17})})
            return [
                message(11, 0, a.metadata.message_id, content=ok),
                message(1, 1, b.metadata.message_id, error=Error(code=3, reason="node unavailable")),
            ]

    grid = FakeGrid()
    log = ReplyLog(grid, tmp_path / "replies.jsonl")
    ids = log.push_messages([message(0, 11, content=RecordDict()), message(0, 22, content=RecordDict())])
    log.pull_messages(ids)
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "replies.jsonl").read_text().splitlines()]
    assert [(x["node_id"], x["partition_id"], x["num_examples"]) for x in lines] == [
        (11, 4, 17),
        (22, None, None),
    ]
    assert lines[0]["error"] is None and lines[1]["error"] == "node unavailable"


def test_out_dir_from_run_config(tmp_path):
    assert experiment_from({"overrides": "", "out-dir": str(tmp_path / "r")})[2] == tmp_path / "r"
    assert experiment_from({"overrides": ""})[2].name.startswith("deploy-")


@pytest.mark.parametrize(
    "overrides, match",
    [
        ("num_clientz=3", "unknown config key 'num_clientz' (did you mean 'num_clients'?)"),
        ("strategy=nope", "strategy='nope' is not allowed: expected one of "),
        ("num_rounds='3", "balanced quotes"),
    ],
)
def test_bad_overrides_are_one_clear_line(overrides, match):
    with pytest.raises(DeployConfigError) as err:
        experiment_from({"overrides": overrides})
    assert match in str(err.value) and "\n" not in str(err.value)


def test_pyproject_declares_the_flower_app():
    import tomllib

    tool = tomllib.loads((APP / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert tool["components"] == {"serverapp": "fedsim.server_app:app", "clientapp": "fedsim.client_app:app"}
    assert set(tool["config"]) == {"overrides", "out-dir"}  # only declared keys may be overridden by flwr run


# ---- commands and certificates -------------------------------------------------------------------------


@needs_flower
@pytest.mark.slow  # starts Flower's processes
def test_commands_use_flags_the_installed_flower_has(tmp_path):
    """Every flag fedsim passes exists in this Flower's --help (1.42 changed several)."""
    sec = Security(tls=True, auth=True, certs=tmp_path)
    link = superlink_command("127.0.0.1", 9093, sec)
    node = supernode_command("127.0.0.1:9093", 9094, 1, 3, sec, max_wait_time=30)
    assert "--enable-supernode-auth" in link and "--insecure" not in link
    assert node[node.index("--auth-supernode-private-key") + 1] == str(tmp_path / "supernode1")
    assert node[-1] == "partition-id=1 num-partitions=3"
    for cmd in (link, node):
        help_text = subprocess.run([cmd[0], "--help"], capture_output=True, text=True, timeout=60).stdout
        for flag in (a for a in cmd if a.startswith("--")):
            assert flag in help_text, f"{cmd[0]} has no {flag}"
    insecure = superlink_command("0.0.0.0", 9093, Security(tls=False, auth=False))
    assert "--insecure" in insecure and not any(a.startswith("--ssl") for a in insecure)


def test_certs_chain_and_node_keys(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_ssh_public_key

    out = make_certs(tmp_path, nodes=2, hosts=("superlink.example.org",))
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    srv = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    srv.verify_directly_issued_by(ca)
    san = srv.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "superlink.example.org" in san.get_values_for_type(x509.DNSName)
    assert {str(a) for a in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    pub = (out / "supernode1.pub").read_text()
    assert (
        pub.startswith("ecdsa-sha2-nistp384 ") and load_ssh_public_key(pub.encode()).curve.name == "secp384r1"
    )
    assert (out / "supernode1").stat().st_mode & 0o077 == 0  # private keys readable by the owner only
    assert not (out / "supernode2").exists()


# ---- bad input: one clear error each, nothing hangs ----------------------------------------------------


def test_superlink_that_does_not_answer_fails_fast():
    t0 = time.monotonic()
    with pytest.raises(DeployError, match=r"did not answer within 1.5 s .*check the address"):
        wait_for_superlink(f"127.0.0.1:{free_port()}", timeout=1.5)
    assert time.monotonic() - t0 < 10


def test_missing_certificates_are_named(tmp_path):
    sec = Security(tls=True, auth=True, certs=tmp_path / "nowhere")
    with pytest.raises(DeployError, match=r"missing certificate/key file: .*nowhere/ca.crt"):
        sec.check(3)
    make_certs(tmp_path / "c", nodes=2)
    with pytest.raises(DeployError, match=r"missing certificate/key file: .*supernode2"):
        Security(tls=True, auth=True, certs=tmp_path / "c").check(3)
    fed = Federation(tmp_path / "w", sec, echo=lambda _: None)
    with pytest.raises(DeployError, match="missing certificate"):
        fed.start_superlink()
    assert fed.procs == {}  # nothing was started
    with pytest.raises(DeployError, match="authentication needs TLS"):
        Security(tls=False, auth=True)


def test_bad_node_settings_are_refused_before_starting(tmp_path):
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(
        DeployError, match=r"partition-id=3 is not allowed: expected an integer in \[0, num-partitions=3\)"
    ):
        check_node(dead, 3, 3, None, None, None, wait=1)
    with pytest.raises(DeployError, match="partition-id=-1"):
        check_node(dead, -1, 3, None, None, None, wait=1)
    with pytest.raises(DeployError, match=r"missing CA certificate file: .*ca.crt"):
        check_node(dead, 0, 3, tmp_path / "ca.crt", None, None, wait=1)
    with pytest.raises(DeployError, match=r"data-dir='.*nope': no such folder"):
        check_node(dead, 0, 3, None, None, str(tmp_path / "nope"), wait=1)
    with pytest.raises(DeployError, match="did not answer"):
        check_node(dead, 0, 3, None, None, None, wait=1)


@pytest.mark.slow  # starts Flower's processes
def test_supernode_subcommand_exits_with_the_error(tmp_path, capsys):
    from fedsim.deploy.__main__ import main

    assert (
        main(
            [
                "supernode",
                "--superlink",
                "127.0.0.1:9",
                "--insecure",
                "--partition-id",
                "0",
                "--num-partitions",
                "2",
                "--data-dir",
                str(tmp_path / "missing"),
            ]
        )
        == 2
    )
    assert "no such folder" in capsys.readouterr().err


# ---- the federation ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    """SuperLink (TLS + node auth) and SuperNodes 0, 1, 2 (node 2 with its own data-dir), all online."""
    root = tmp_path_factory.mktemp("deploy")
    certs = make_certs(root / "certs", nodes=N)
    ds = build.build_dataset(json.loads(build.client_spec(compose_cfg(*TINY), device="cpu")))
    n, v = NODE2_TRAIN, NODE2_VAL
    save_node_data(
        root / "node2-data", ds.x_train[:n], ds.y_train[:n], ds.x_train[n : n + v], ds.y_train[n : n + v]
    )
    f = Federation(root / "work", Security(tls=True, auth=True, certs=certs), cwd=root, echo=lambda _: None)
    f.root = root
    try:
        f.start_superlink(timeout=120)
        for i in range(N):
            f.register(i)
        for i in range(N):
            f.start_supernode(i, N, data_dir=str(root / "node2-data") if i == 2 else None)
        f.wait_nodes_online(N, timeout=180)
        yield f
    finally:
        f.stop()
        left = [p for p in f.stopped if running(p)]
        assert f.stopped and not left, f"processes left running: {left}"


def _online(fed: Federation) -> list[dict]:
    return [n for n in fed.nodes() if n.get("status") == "online"]


def _start_run(fed: Federation, name: str, overrides: list[str]) -> tuple[int, Path]:
    out = fed.root / name
    return fed.submit(APP, {"overrides": shlex.join(overrides), "out-dir": str(out)}), out


def _finish(fed: Federation, run_id: int, out: Path, timeout: float = 300) -> dict:
    status = fed.wait_run(run_id, timeout, poll=1.0, done=(out / "summary.json").exists)
    if status["status"] != "finished:completed":
        pytest.fail(f"run {run_id}: {status}\n{fed.run_log(run_id)[-3000:]}")
    return status


def _replies(out: Path, kind: str) -> list[dict]:
    lines = [json.loads(x) for x in (out / "replies.jsonl").read_text().splitlines() if x]
    return [r for r in lines if r["type"] == kind]


def _wait_for(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.25)


@needs_flower
@pytest.mark.slow  # starts Flower's processes
def test_unregistered_key_is_refused(fed):
    stranger = make_node_key(fed.root / "stranger" / "key")
    fed.start_supernode(0, N, key=stranger, name="stranger", max_wait_time=60)
    code = fed.wait_exit("stranger", timeout=120)
    log = fed.log_tail("stranger", 40)
    assert code != 0 and "Failed to activate SuperNode" in log, log
    assert len(_online(fed)) == N


def _expected_examples(overrides: list[str]) -> dict[int, int]:
    """Training examples per partition: the partitioner's share for nodes 0 and 1, node 2's own folder."""
    spec = json.loads(build.client_spec(compose_cfg(*overrides), device="cpu"))
    shares = build.build_partitions(spec)[0]
    assert len(shares[2]) != NODE2_TRAIN  # otherwise the data-dir check would prove nothing
    return {0: len(shares[0]), 1: len(shares[1]), 2: NODE2_TRAIN}


def _check_replies(
    fed: Federation, out: Path, overrides: list[str], lost_node: int | None = None
) -> list[dict]:
    """Every reply came from the node whose registered key belongs to its partition, with that partition's data.

    Returns the train replies without errors. Only ``lost_node`` may have error replies (the SuperLink's own
    reply for a node whose heartbeats stopped), at most one.
    """
    train = _replies(out, "train")
    errors = [r for r in train if r["error"]]
    assert len(errors) <= (lost_node is not None) and all(r["node_id"] == lost_node for r in errors), errors
    train = [r for r in train if not r["error"]]
    assert train
    for r in _replies(out, "query") + train:
        assert r["node_id"] == fed.node_ids[r["partition_id"]]
    expected = _expected_examples(overrides)
    assert all(r["num_examples"] == expected[r["partition_id"]] for r in train)
    return train


@needs_flower
@pytest.mark.slow  # starts Flower's processes
def test_fedbuff_in_wall_clock_arrival_order(fed):
    """FedBuff (K=2) with all three nodes busy: two server versions from real replies in arrival order."""
    overrides = [*TINY, "strategy=fedbuff", "strategy.buffer_size=2", "num_rounds=2", "round_timeout=120"]
    run_id, out = _start_run(fed, "fedbuff", overrides)
    _finish(fed, run_id, out)
    records = read_metrics(out)
    assert [r["round"] for r in records] == [0, 1, 2]
    assert [r["num_clients"] for r in records[1:]] == [2, 2] and records[2]["updates_total"] == 4
    assert all(r["failures"] == 0 for r in records[1:])
    # deployment: sim_time is wall-clock seconds since the start, not the simulated clock
    assert 0 < records[1]["sim_time"] <= records[2]["sim_time"] < 600
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["engine"] == "deployment"
    train = _check_replies(fed, out, overrides)
    assert len(train) >= 4 and {r["partition_id"] for r in train} == {0, 1, 2}
    times = [r["time"] for r in train]
    assert times == sorted(times)


@needs_flower
@pytest.mark.slow  # starts Flower's processes
def test_sync_fedavg_each_node_its_own_partition_and_a_lost_node_times_out(fed):
    """Three synchronous FedAvg rounds; SuperNode 2 is killed (with its helpers) after round 2.

    Rounds 1-2: all three nodes reply, each with its own partition (0 and 1: the partitioner's share,
    2: its own folder). Round 3: node 2 never replies; the round waits ``round_timeout`` seconds, records a
    timeout and aggregates the other two; the run completes.
    """
    overrides = [*TINY, "num_rounds=3", "round_timeout=45"]
    run_id, out = _start_run(fed, "sync", overrides)
    _wait_for(lambda: (out / "metrics.jsonl").exists() and len(read_metrics(out)) >= 3, 300, "round 2")
    fed.kill("supernode2")
    _finish(fed, run_id, out)

    records = read_metrics(out)
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    assert [r["num_clients"] for r in records[1:]] == [3, 3, 2]
    assert [r["failures"] for r in records[1:]] == [0, 0, 1]
    # no reply within round_timeout, or the SuperLink noticed the missing heartbeats first
    assert records[3]["failure_kinds"] in ({"timeout": 1}, {"unavailable": 1})
    assert records[2]["eval_loss"] < records[0]["eval_loss"]
    summary = json.loads((out / "summary.json").read_text())
    assert (
        summary["status"] == "completed" and summary["engine"] == "deployment" and summary["rounds_done"] == 3
    )

    train = _check_replies(fed, out, overrides, lost_node=fed.node_ids[2])
    assert sorted(r["partition_id"] for r in train) == [0, 0, 0, 1, 1, 1, 2, 2]


@pytest.mark.slow  # starts Flower's processes
def test_local_submits_the_fedsim_checkout_wherever_it_is_started(tmp_path, monkeypatch):
    from fedsim.deploy.__main__ import app_folder
    from fedsim.deploy.launch import DeployError

    monkeypatch.chdir(tmp_path)
    checkout = app_folder(None)
    assert (checkout / "pyproject.toml").is_file() and (checkout / "fedsim" / "server_app.py").is_file()
    with pytest.raises(DeployError, match="not a Flower App folder"):
        app_folder(tmp_path)
