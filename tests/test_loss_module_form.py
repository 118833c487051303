"""``MPTLoss()(model, guide)``, the module form that Lightning recipes train with, calls
``differentiable_loss`` alone: nothing reads the loss back, so the checks that a steady call
leaves on the device with Pyro's validation off are read at the next call instead of never."""

import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import Exact, ImportanceSampling

WEIGHT = torch.tensor([[1.0, 0.5], [-0.3, 0.8], [0.6, -0.2], [0.2, 0.9], [-0.7, 0.1], [0.4, 0.4]])


def _model(x):
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        pyro.sample("x", dist.Normal(z @ WEIGHT.T, 0.3).to_event(1), obs=x)


def _far_guide(x):
    # A narrow proposal far from every posterior: the weights fail on every call.
    with pyro.plate("data", x.shape[-2]):
        pyro.sample("z", dist.Normal(torch.full((2,), 4.0), 0.05).to_event(1))


def _importance_warnings(through_module):
    loss = MPTLoss(conditionals=ImportanceSampling(16))
    data = dist.Normal(0.0, 1.0).sample((4, 8, 6))
    module = loss(_model, _far_guide)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(12):
            if through_module:
                module(data[step % 4])
            else:
                loss.loss_and_grads(_model, _far_guide, data[step % 4])
        module(data[0]) if through_module else None  # reads the 12th call's check
    return [w for w in caught if "cannot be trusted" in str(w.message)]


def test_failing_importance_weights_warn_through_the_module_form_as_through_svi():
    pyro.enable_validation(False)
    through_svi = _importance_warnings(through_module=False)
    pyro.clear_param_store()
    through_module = _importance_warnings(through_module=True)
    # The first failing call, and the tenth with the count of failures so far.
    assert len(through_svi) == 2
    assert len(through_module) == len(through_svi)
    assert "10 of the 10 calls so far failed" in str(through_module[-1].message)
    assert all(w.filename == __file__ for w in through_module)  # the user's line


class _Switch:
    """A linear-Gaussian model until ``bent`` is set, then a nonlinear one of the same
    shapes: a change that no argument shows."""

    bent = False

    def model(self, x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
            loc = z @ WEIGHT.T
            if self.bent:
                loc = loc + 0.5 * z[..., :1] ** 2
            pyro.sample("x", dist.Normal(loc, 0.3).to_event(1), obs=x)


def test_a_form_that_stopped_holding_is_told_and_read_afresh_at_the_next_module_call():
    pyro.enable_validation(False)
    switch = _Switch()
    loss = MPTLoss(conditionals=Exact(), num_masks=2)
    module = loss(switch.model, None)
    data = dist.Normal(0.0, 1.0).sample((8, 6))
    for _ in range(3):  # past the second call, on which the form is verified anyway
        module(data)
    switch.bent = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module(data)  # a steady call: its check stays on the device
    with pytest.warns(RuntimeWarning, match="no longer has it") as caught:
        with pytest.raises(ValueError, match="not affine"):
            module(data)  # reads it, then reads the model afresh, verified
    assert caught[0].filename == __file__


def _tanh_model(x):
    with pyro.plate("data", x.shape[-2]):
        z = pyro.sample("z", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        pyro.sample("x", dist.Normal(torch.tanh(z @ WEIGHT.T), 0.5).to_event(1), obs=x)


@pytest.mark.parametrize(
    "model, conditionals",
    [(_model, "auto"), (_tanh_model, "auto"), (_tanh_model, "quadrature"), (_model, "importance")],
)
def test_a_called_loss_pickles_and_its_copy_scores_as_it_does(model, conditionals):
    # ddp_spawn pickles the LightningModule, and with it the loss: a loss that had been
    # called held traces and weak references, and failed to pickle or deep-copy.
    import copy
    import pickle

    from pyro.infer.autoguide import AutoNormal

    guide = AutoNormal(model)
    x = dist.Normal(0.0, 1.0).sample((8, 6))
    loss = MPTLoss(conditionals=conditionals, num_masks=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # accuracy warnings of an untrained guide
        for _ in range(2):
            loss.loss(model, guide, x)
        copies = [pickle.loads(pickle.dumps(loss)), copy.deepcopy(loss)]
        values = []
        for scorer in [loss, *copies]:
            pyro.set_rng_seed(7)
            values.append(scorer.loss(model, guide, x))
    assert values[1] == pytest.approx(values[0], rel=1e-12)
    assert values[2] == pytest.approx(values[0], rel=1e-12)
    assert copies[0].num_masks == 3 and repr(copies[0].schedule) == repr(loss.schedule)
