import copy

import pytest
import torch
from torch.nn import functional as F

from fedsim import models
from fedsim.training import LocalTraining, evaluate, num_local_steps, train_local


def _data(n=40, d=6, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, c, (n,), generator=g)


def test_step_counts_follow_epochs_steps_and_full_batch():
    assert num_local_steps(40, LocalTraining(local_epochs=2, batch_size=16)) == 6  # ceil(40/16)=3 per epoch
    assert num_local_steps(40, LocalTraining(local_steps=5, batch_size=16)) == 5
    assert num_local_steps(40, LocalTraining(local_epochs=3, batch_size=0)) == 3
    x, y = _data()
    net = models.logreg((6,), 3)
    _, steps, seen = train_local(net, x, y, LocalTraining(local_epochs=2, batch_size=16), torch.Generator())
    assert (steps, seen) == (6, 80)


def test_one_full_batch_sgd_step_is_plain_gradient_descent():
    x, y = _data()
    net = models.logreg((6,), 3)
    ref = copy.deepcopy(net)
    train_local(
        net, x, y, LocalTraining(optimizer="sgd", lr=0.3, local_steps=1, batch_size=0), torch.Generator()
    )
    loss = F.cross_entropy(ref(x), y)
    grads = torch.autograd.grad(loss, list(ref.parameters()))
    for p, r, g in zip(net.parameters(), ref.parameters(), grads):
        torch.testing.assert_close(p, r - 0.3 * g)


def test_proximal_term_keeps_model_closer_to_start():
    x, y = _data()
    base = models.mlp((6,), 3, hidden=(8,))
    cfg = LocalTraining(lr=0.2, local_epochs=5, batch_size=8)
    dist = {}
    for mu in (0.0, 2.0):
        net = copy.deepcopy(base)
        train_local(net, x, y, cfg, torch.Generator().manual_seed(1), proximal_mu=mu)
        dist[mu] = sum(
            float(((p.detach() - q.detach()) ** 2).sum()) for p, q in zip(net.parameters(), base.parameters())
        )
    assert dist[2.0] < 0.5 * dist[0.0]


def test_asgd_returns_the_average_of_its_iterates():
    x, y = _data()
    base = models.logreg((6,), 3)
    cfg = LocalTraining(optimizer="asgd", lr=0.5, local_steps=3, batch_size=0)
    net = copy.deepcopy(base)
    train_local(net, x, y, cfg, torch.Generator())
    # replay the three plain GD iterates by hand and average them
    ref = copy.deepcopy(base)
    iterates = []
    for _ in range(3):
        grads = torch.autograd.grad(F.cross_entropy(ref(x), y), list(ref.parameters()))
        with torch.no_grad():
            for p, g in zip(ref.parameters(), grads):
                p -= 0.5 * g
        iterates.append([p.detach().clone() for p in ref.parameters()])
    for i, p in enumerate(net.parameters()):
        torch.testing.assert_close(p, sum(it[i] for it in iterates) / 3)


@pytest.mark.parametrize("opt", ["sgd", "momentum", "nesterov", "adam", "asgd"])
def test_every_optimizer_reduces_training_loss(opt):
    x, y = _data(n=64)
    net = models.mlp((6,), 3, hidden=(16,))
    before, _ = evaluate(net, x, y)
    lr = 0.01 if opt == "adam" else 0.1
    train_local(
        net,
        x,
        y,
        LocalTraining(optimizer=opt, lr=lr, local_epochs=20, batch_size=16),
        torch.Generator().manual_seed(0),
    )
    after, _ = evaluate(net, x, y)
    assert after < before


def test_same_generator_seed_same_result():
    x, y = _data()
    cfg = LocalTraining(local_epochs=2, batch_size=8)
    nets = [models.logreg((6,), 3) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    for net in nets:
        train_local(net, x, y, cfg, torch.Generator().manual_seed(42))
    assert all(torch.equal(a, b) for a, b in zip(nets[0].parameters(), nets[1].parameters()))


@pytest.mark.parametrize(
    "optimizer, momentum, weight_decay",
    [
        ("sgd", 0.0, 0.0),
        ("sgd", 0.0, 0.01),
        ("momentum", 0.9, 0.0),
        ("nesterov", 0.8, 0.001),
        ("asgd", 0.0, 0.0),
    ],
)
def test_fedsims_sgd_is_torchs_sgd_bit_for_bit(optimizer, momentum, weight_decay):
    """``fedsim.local.SGD`` (the rule the batched engine applies to stacked rows) against ``torch.optim.SGD``."""
    import torch

    from fedsim.local import LocalTraining, make_optimizer

    cfg = LocalTraining(optimizer=optimizer, lr=0.1, momentum=momentum, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=gen), torch.randn(3, generator=gen)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(4)]
    ours = [p.clone().requires_grad_() for p in start]
    theirs = [p.clone().requires_grad_() for p in start]
    opt = make_optimizer(ours, cfg)
    kw = (
        {"momentum": momentum, "nesterov": optimizer == "nesterov"}
        if optimizer in ("momentum", "nesterov")
        else {}
    )
    ref = torch.optim.SGD(theirs, lr=0.1, weight_decay=weight_decay, **kw)
    for step in grads:
        for o, t, g in zip(ours, theirs, step):
            o.grad, t.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        assert all(torch.equal(o, t) for o, t in zip(ours, theirs))


@pytest.mark.parametrize(
    "optimizer, weight_decay", [("sgd", 0.0), ("sgd", 0.01), ("momentum", 0.0), ("nesterov", 0.01)]
)
def test_a_gradient_given_as_an_unformed_product_takes_the_same_sgd_step(
    optimizer, weight_decay, monkeypatch
):
    """The batched engine hands ``sgd_update_`` a stacked weight's gradient as ``Outer(a, b)`` (``a @ b`` not
    formed): plain SGD steps along it in one ``baddbmm_``, the exact step to float rounding; anything else
    forms the product and is the formed gradient's step bit for bit."""
    import torch

    from fedsim.local import LocalTraining, Outer, sgd_update_

    cfg = LocalTraining(optimizer=optimizer, lr=0.1, momentum=0.9, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(3, 4, 6, generator=gen)
    steps = [(torch.randn(3, 4, 5, generator=gen), torch.randn(3, 5, 6, generator=gen)) for _ in range(3)]
    keeps = optimizer != "sgd"
    fused = []
    real = torch.Tensor.baddbmm_
    monkeypatch.setattr(torch.Tensor, "baddbmm_", lambda *a, **kw: fused.append(1) or real(*a, **kw))
    lazy, formed = start.clone(), start.clone()
    bufs = (torch.zeros_like(start), torch.zeros_like(start)) if keeps else (None, None)
    exact = start.double()
    for a, b in steps:
        sgd_update_(lazy, Outer(a, b), bufs[0], cfg)
        sgd_update_(formed, torch.bmm(a, b), bufs[1], cfg)
        if not keeps and weight_decay == 0:
            exact -= 0.1 * (a.double() @ b.double())
    if keeps or weight_decay:
        assert torch.equal(lazy, formed) and not fused
    else:
        torch.testing.assert_close(lazy.double(), exact, rtol=0, atol=1e-6)
        torch.testing.assert_close(formed.double(), exact, rtol=0, atol=1e-6)
        assert len(fused) == len(steps)  # one fused step each, the product never formed
