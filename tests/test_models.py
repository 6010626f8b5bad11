import pytest
import torch

from fedsim import models
from fedsim.errors import ConfigError


@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28), (3, 32, 32), (60,)])
@pytest.mark.parametrize("factory", [models.logreg, models.mlp])
def test_dense_models_map_inputs_to_logits(factory, shape):
    net = factory(input_shape=shape, num_classes=7)
    assert net(torch.zeros(5, *shape)).shape == (5, 7)


@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28), (3, 32, 32)])
def test_cnn_adapts_to_image_shape(shape):
    net = models.cnn(input_shape=shape, num_classes=10)
    assert net(torch.zeros(2, *shape)).shape == (2, 10)


def test_cnn_rejects_vectors_and_too_many_blocks():
    with pytest.raises(ConfigError, match="model"):
        models.cnn(input_shape=(60,), num_classes=10)
    with pytest.raises(ConfigError, match="channels"):
        models.cnn(input_shape=(1, 8, 8), num_classes=10, channels=(4, 4, 4, 4))


def test_build_model_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = models.build_model(models.mlp, (1, 8, 8), 10, seed=5)
    assert torch.equal(torch.rand(1), expected_next)  # the global RNG did not move
    b = models.build_model(models.mlp, (1, 8, 8), 10, seed=5)
    c = models.build_model(models.mlp, (1, 8, 8), 10, seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


@pytest.mark.parametrize(
    "factory, kwargs, key",
    [
        (models.mlp, {"hidden": 64}, "hidden"),
        (models.mlp, {"hidden": "abc"}, "hidden"),
        (models.mlp, {"hidden": [64.5]}, "hidden"),
        (models.mlp, {"hidden": [0]}, "hidden"),
        (models.cnn, {"channels": 16}, "channels"),
        (models.cnn, {"channels": [16, float("nan")]}, "channels"),
        (models.cnn, {"hidden": 0}, "hidden"),
        (models.cnn, {"hidden": True}, "hidden"),
    ],
)
def test_layer_widths_that_are_not_positive_integers_are_one_config_error(factory, kwargs, key):
    shape = (1, 8, 8)
    with pytest.raises(ConfigError) as e:
        factory(shape, 10, **kwargs)
    assert e.value.key == key and "\n" not in str(e.value)
