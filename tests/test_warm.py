"""The warm SuperExec's FAB installed once (``fedsim.deploy.warm.install_once``): Flower's ``install_from_fab``
extracts and checks a FAB on every message; the warm one does it once per FAB's bytes, and only that."""

from __future__ import annotations

import hashlib
import io
import zipfile

import pytest

from fedsim.deploy.warm import install_once


class CountingInstall:
    """Stands for Flower's ``install_from_fab``: makes the App folder under FLWR_HOME, counts its calls."""

    def __init__(self, home) -> None:
        self.home, self.calls = home, []

    def __call__(self, fab, install_dir=None, skip_prompt=False):
        self.calls.append((fab, install_dir, skip_prompt))
        folder = self.home / "apps" / f"app.{len(self.calls)}"
        folder.mkdir(parents=True)
        return folder


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    return tmp_path / "flwr-home"


def test_a_fab_is_installed_once_while_its_folder_stays(home):
    stock = CountingInstall(home)
    install = install_once(stock)
    first = install(b"fab one", skip_prompt=True)
    assert install(b"fab one", skip_prompt=True) == first and len(stock.calls) == 1
    note = home / "apps" / ".fedsim-installed" / hashlib.sha256(b"fab one").hexdigest()
    assert note.read_text() == str(first)
    other = install(b"fab two", skip_prompt=True)  # other bytes: Flower installs (and checks) them
    assert other != first and len(stock.calls) == 2
    first.rmdir()  # the App's folder removed: installed again
    assert install(b"fab one", skip_prompt=True) != first and len(stock.calls) == 3
    assert install(b"fab one", skip_prompt=True) == stock.home / "apps" / "app.3" and len(stock.calls) == 3


def test_what_is_not_the_clientapps_call_goes_to_flower_every_time(home, tmp_path):
    stock = CountingInstall(home)
    install = install_once(stock)
    install(b"fab", skip_prompt=True)
    install(b"fab")  # a prompt asked for
    install(b"fab", tmp_path / "elsewhere", skip_prompt=True)  # another folder
    install(tmp_path / "app.fab", skip_prompt=True)  # a path, not the bytes a ClientApp pulls
    assert len(stock.calls) == 4


def test_a_fab_flower_refuses_is_refused_every_time_and_never_noted(home):
    """A FAB whose files do not match its hashes: Flower's real ``install_from_fab`` refuses it, on each call."""
    import click
    from flwr.supernode.runtime import run_clientapp

    fab = io.BytesIO()
    with zipfile.ZipFile(fab, "w") as z:
        z.writestr("pyproject.toml", "[project]\nname = 'x'\n")
        z.writestr(".info/CONTENT", "pyproject.toml,0000,22\n")  # a wrong hash
    install = install_once(run_clientapp.install_from_fab)
    for _ in range(2):
        with pytest.raises(click.ClickException, match="hashes"):
            install(fab.getvalue(), skip_prompt=True)
    assert not (home / "apps" / ".fedsim-installed").exists()
