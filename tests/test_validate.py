"""``fedsim.validate`` reads which keys are on/off switches from ``conf/`` with PyYAML's C loader: the same
answer as OmegaConf's own loader (the oracle), file by file."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fedsim import validate

CONF = Path(str(validate._conf()))
FILES = sorted(CONF.rglob("*.yaml"))


def test_conf_has_option_files():
    assert len(FILES) > 50


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(CONF)))
def test_the_fast_loader_finds_the_same_booleans_as_omegaconf(path):
    oracle = OmegaConf.to_container(OmegaConf.load(str(path)), resolve=False) or {}
    assert validate._bool_paths(validate._yaml(path)) == validate._bool_paths(oracle)


def test_yaml_1_1_switch_words_are_booleans_for_both_loaders(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("a: on\nb: 'on'\nc: no\nd: 2001-12-14\ne: 1e3\nf: {g: true}\n")
    oracle = OmegaConf.to_container(OmegaConf.load(str(path)), resolve=False)
    found = validate._bool_paths(validate._yaml(path))
    assert (
        found
        == validate._bool_paths(oracle)
        == {"a": True, "b": False, "c": True, "d": False, "e": False, "f.g": True}
    )


def test_boolean_keys_are_read_from_every_group():
    keys = validate.boolean_keys()
    assert {"quiet", "federated_eval", "dataset.iid", "clipping.debug_noise_seed"} <= set(keys)
    assert "num_rounds" not in keys and "strategy.name" not in keys
