"""Runs at points shared by every observation: compact where that is the same model, full
size where the model treats its latents per observation.

Each model is linear-Gaussian, so ``log p(x_i)`` has a closed form computed here; a run that
broadcast one observation's terms to all of them would miss it by far more than the
tolerance.
"""

import pyro
import pyro.distributions as dist
import pytest
import torch

from experiments.zoo.references import mvn_log_prob
from pyro_mpt import log_marginal
from pyro_mpt.conditionals import Exact, Quadrature
from pyro_mpt.trace.model_structure import read_structure
from pyro_mpt.trace.whitened_latents import run_at_points
from tests.helpers import dense_schur_log_conditionals

NUM_DATA, NUM_FEATURES, NOISE = 6, 3, 1.0


def _setup(seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(NUM_FEATURES, generator=generator)
    covariate_weight = torch.randn(NUM_FEATURES, generator=generator)
    bias = torch.randn(NUM_DATA, NUM_FEATURES, generator=generator)
    covariates = torch.randn(NUM_DATA, 1, generator=generator)
    x = torch.randn(NUM_DATA, NUM_FEATURES, generator=generator)
    return weight, covariate_weight, bias, covariates, x


def _reference(weight, loc, x):
    cov = torch.outer(weight, weight) + NOISE**2 * torch.eye(NUM_FEATURES)
    return mvn_log_prob(x, loc, cov)


def concatenated_model(x):
    """A conditional decoder: the latent concatenated with the observation's covariate."""
    weight, covariate_weight, _, covariates, _ = _setup()
    loadings = torch.stack([weight, covariate_weight], -1)  # (D, 2)
    with pyro.plate("data", NUM_DATA):
        z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
        inputs = torch.cat([z, covariates.expand(z.shape[:-1] + (1,))], -1)
        loc = inputs @ loadings.T
        pyro.sample("x", dist.Normal(loc, NOISE).to_event(1), obs=x)


def arange_indexed_model(x):
    """Per-observation offsets indexed by ``arange`` over the latent's observation dim: a
    run with that dim of size one would silently give every observation the first offset."""
    weight, _, bias, _, _ = _setup()
    with pyro.plate("data", NUM_DATA):
        z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
        offsets = bias[torch.arange(z.shape[-2])]
        pyro.sample("x", dist.Normal(z * weight + offsets, NOISE).to_event(1), obs=x)


def _data_and_reference(model):
    weight, covariate_weight, bias, covariates, x = _setup()
    if model is concatenated_model:
        loc = covariates * covariate_weight
    else:
        loc = bias
    return x, _reference(weight, loc, x)


@pytest.mark.parametrize("model", [concatenated_model, arange_indexed_model])
@pytest.mark.parametrize("strategy", ["exact", "quadrature"])
def test_per_observation_latents_are_integrated_right(model, strategy):
    x, reference = _data_and_reference(model)
    conditionals = Exact() if strategy == "exact" else Quadrature(num_points=150)
    with torch.no_grad():
        value = log_marginal(model, x, conditionals=conditionals)
    torch.testing.assert_close(value, reference, atol=1e-8, rtol=1e-8)


@pytest.mark.parametrize("model", [concatenated_model, arange_indexed_model])
@pytest.mark.parametrize("strategy", ["exact", "quadrature"])
def test_conditionals_match_dense_schur_complements(model, strategy):
    """``log p(x_j | x_R)`` of the layout ``MPTLoss`` uses, on every observation and mask."""
    x, _ = _data_and_reference(model)
    weight, covariate_weight, bias, covariates, _ = _setup()
    loc = covariates * covariate_weight if model is concatenated_model else bias
    cov = torch.outer(weight, weight) + NOISE**2 * torch.eye(NUM_FEATURES)
    conditionals = Exact() if strategy == "exact" else Quadrature(num_points=150)
    masks = torch.rand(NUM_DATA, NUM_FEATURES, generator=torch.Generator().manual_seed(2)) < 0.5
    masks[:, 0] = True
    with torch.no_grad():
        prepared = conditionals.prepare(model, None, (x,), {}, max_plate_nesting=1)
        values = prepared.log_prob(masks.unsqueeze(0))[0]
    assert prepared.observed.value.shape == x.shape
    for i in range(NUM_DATA):
        expected = dense_schur_log_conditionals(x[i], loc[i], cov, masks[i])
        for j, value in expected.items():
            torch.testing.assert_close(values[i, j], value, atol=1e-8, rtol=1e-8)
    structure = conditionals._structure.get(model, (x,), {}, 1)
    assert structure.point_layout.shared is False


def test_shared_layout_for_models_alike_for_every_observation():
    """A decoder that broadcasts its latent runs once per point, not once per observation."""
    weight, _, _, _, x = _setup()

    def model(x):
        with pyro.plate("data", NUM_DATA):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            pyro.sample("x", dist.Normal(z * weight, NOISE).to_event(1), obs=x)

    with torch.no_grad():
        structure = read_structure(model, (x,), {})
        points = torch.randn(5, 1, generator=torch.Generator().manual_seed(1))
        run = run_at_points(model, (x,), {}, structure, points)
    assert structure.point_layout.shared is True
    assert run.fn.base_dist.loc.stride(-2) == 0  # one decoder output per point, broadcast
    torch.testing.assert_close(
        log_marginal(model, x), _reference(weight, torch.zeros(NUM_FEATURES), x)
    )
