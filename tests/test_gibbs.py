"""gibbs: block Gibbs chains against the model's joint distribution."""

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_mpt import gibbs
from pyro_mpt.models import PPCA
from pyro_mpt.ops.conditional_sampling import block_gibbs_covariance

NUM_SE = 4.5


def _ppca():
    # Strongly correlated features: one large loading direction, small noise.
    ppca = PPCA(4, 1, init_scale=1.0, noise_scale=0.5)
    ppca.weight = torch.tensor([[2.0], [1.5], [-1.0], [2.5]])
    return ppca


def _covariance_se(cov, n):
    var = cov.diagonal()
    return ((var[:, None] * var[None, :] + cov**2) / n).sqrt()


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_joint_chain_keeps_the_model_distribution(block_size):
    # Chains started at draws of p(x) stay draws of p(x) after any number of exact steps.
    ppca = _ppca()
    x = ppca.sample(4000)
    chain = gibbs(ppca.model, x, block_size=block_size, num_steps=3, progress=False)
    cov = ppca.covariance().detach()
    sample_cov = torch.cov(chain[-1].T)
    assert ((sample_cov - cov).abs() <= NUM_SE * _covariance_se(cov, 4000)).all()
    assert ((chain[-1].mean(0) - ppca.loc).abs() <= NUM_SE * (cov.diagonal() / 4000).sqrt()).all()


def test_product_chain_of_all_features_draws_independent_marginals():
    # block_size = D: every feature from its marginal; no dependence is left.
    ppca = _ppca()
    x = ppca.sample(4000)
    chain = gibbs(ppca.model, x, block_size=4, num_steps=1, joint=False, progress=False)
    cov = ppca.covariance().detach()
    independent = torch.diag(cov.diagonal())
    sample_cov = torch.cov(chain[-1].T)
    assert ((sample_cov - independent).abs() <= NUM_SE * _covariance_se(independent, 4000)).all()
    # ...which is far from the model's covariance.
    off = ~torch.eye(4, dtype=torch.bool)
    assert ((sample_cov - cov)[off].abs() > 10 * _covariance_se(cov, 4000)[off]).all()


def test_product_chain_reaches_its_closed_form_stationary_covariance():
    # Each step maps x linearly plus Gaussian noise: the stationary covariance solves a
    # linear system (block_gibbs_covariance), and it is not the model's.
    ppca = _ppca()
    n = 20000
    x = ppca.sample(n)
    chain = gibbs(ppca.model, x, block_size=3, num_steps=20, joint=False, progress=False)
    cov = ppca.covariance().detach()
    stationary = block_gibbs_covariance(cov, 3, joint=False)
    sample_cov = torch.cov(chain[-1].T)
    assert ((sample_cov - stationary).abs() <= NUM_SE * _covariance_se(stationary, n)).all()
    assert ((sample_cov - cov).abs() > NUM_SE * _covariance_se(cov, n)).any()


def test_block_gibbs_covariance_closed_form():
    cov = _ppca().covariance().detach()
    for block_size in range(1, 5):
        assert torch.allclose(block_gibbs_covariance(cov, block_size), cov)
    assert torch.allclose(block_gibbs_covariance(cov, 1, joint=False), cov)
    assert torch.allclose(block_gibbs_covariance(cov, 4, joint=False), torch.diag(cov.diagonal()))
    assert not torch.allclose(block_gibbs_covariance(cov, 2, joint=False), cov, atol=0.1)


def test_chain_starts_at_data_and_changes_one_block_per_step():
    ppca = _ppca()
    x = ppca.sample(5)
    chain = gibbs(ppca.model, x, block_size=3, num_steps=4, progress=False)
    assert chain.shape == (5, 5, 4)
    assert torch.equal(chain[0], x)
    changed = (chain[1:] != chain[:-1]).sum(-1)
    assert (changed == 3).all()


def bimodal_model(x):
    with pyro.plate("data", x.shape[0]):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        logits = 4.0 * z.unsqueeze(-1) * torch.ones(6)
        pyro.sample("x", dist.Bernoulli(logits=logits).to_event(1), obs=x)


def test_joint_chain_keeps_a_bimodal_distribution():
    # Under the model all six bits agree with probability p_same; exact steps keep it.
    n = 3000
    z = torch.randn(n, 1)
    x = torch.bernoulli(torch.sigmoid(4.0 * z).expand(n, 6))
    grid = torch.linspace(-9.0, 9.0, 8001)
    probs = torch.sigmoid(4.0 * grid)
    weights = dist.Normal(0.0, 1.0).log_prob(grid).softmax(0)
    p_same = float((weights * (probs**6 + (1 - probs) ** 6)).sum())
    chain = gibbs(bimodal_model, x, block_size=2, num_steps=4, conditionals="quadrature",
                  progress=False)  # fmt: skip
    same = (chain[-1].sum(-1) % 6 == 0).double().mean()
    assert abs(same - p_same) <= NUM_SE * (p_same * (1 - p_same) / n) ** 0.5


def test_errors_name_argument_value_and_fix():
    ppca = _ppca()
    x = ppca.sample(3)
    with pytest.raises(ValueError, match=r"block_size must be between 1 and 4, got 0\. .*D=4"):
        gibbs(ppca.model, x, block_size=0, num_steps=1)
    with pytest.raises(ValueError, match="block_size must be between 1 and 4, got 5"):
        gibbs(ppca.model, x, block_size=5, num_steps=1)
    with pytest.raises(TypeError, match="block_size must be an integer, got 1.5"):
        gibbs(ppca.model, x, block_size=1.5, num_steps=1)
    with pytest.raises(ValueError, match=r"num_steps must be at least 0, got -1\. Pass"):
        gibbs(ppca.model, x, block_size=1, num_steps=-1)
    with pytest.raises(TypeError, match="joint must be True or False, got 'yes'"):
        gibbs(ppca.model, x, block_size=1, num_steps=1, joint="yes")

    def model(n, x):
        ppca.model(x)

    with pytest.raises(TypeError, match="first positional argument.*got int 3"):
        gibbs(model, 3, x, block_size=1, num_steps=1)
    with pytest.raises(TypeError, match="got no positional argument"):
        gibbs(ppca.model, block_size=1, num_steps=1)

    def padded(y, x):
        ppca.model(x)

    with pytest.raises(ValueError, match=r"shape \(3, 2\) and the observed site 'x' has shape"):
        gibbs(padded, x[:, :2], x, block_size=1, num_steps=1)


def test_a_first_argument_the_model_does_not_observe_as_it_is_is_refused():
    # The chain feeds its draws back as the first argument: a model observing x / 10 would
    # shrink the state tenfold at every step, and a covariate of the data's shape passed
    # first would be replaced by draws of the data.
    ppca = _ppca()
    x = ppca.sample(3)

    def scaled(x):
        ppca.model(x / 10)

    def covariate_first(u, x):
        ppca.model(x + 0 * u)

    match = "the observed site 'x' does not hold that argument's values"
    with pytest.raises(ValueError, match=match):
        gibbs(scaled, x, block_size=1, num_steps=2, progress=False)
    with pytest.raises(ValueError, match=match):
        gibbs(covariate_first, torch.randn(3, 4), x, block_size=1, num_steps=2, progress=False)


def test_entries_the_model_masks_are_never_redrawn_and_the_rest_keep_p_x_observed():
    # A masked entry was redrawn whenever it fell in a block but never used as context, so
    # the chain's joint of it and the others was no distribution of the model. It now keeps
    # its state, and the counted entries keep their exact joint: chains started at draws of
    # p(x) have the closed-form covariance of the two unmasked features of row 0.
    ppca = _ppca()
    num_chains = 4000
    pyro.set_rng_seed(0)
    x = ppca.sample(num_chains)
    kept = torch.ones(num_chains, 4, dtype=torch.bool)
    kept[:, 1] = False
    x[:, 1] = 99.0

    def fixed_mask(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([1]).to_event(1))
            loc = z @ ppca.weight.T
            likelihood = dist.Normal(loc, ppca.noise_scale).mask(kept).to_event(1)
            pyro.sample("x", likelihood, obs=x)

    chain = gibbs(fixed_mask, x, block_size=2, num_steps=5, progress=False)
    assert (chain[:, :, 1] == 99.0).all()
    w, var = ppca.weight.detach(), ppca.noise_scale.detach() ** 2
    cov = w @ w.T + var * torch.eye(4)
    final = chain[-1][:, [0, 2, 3]].double()
    sub = cov[[0, 2, 3]][:, [0, 2, 3]].double()
    se = _covariance_se(sub, num_chains)
    assert ((final.T.cov() - sub).abs() <= NUM_SE * se).all()


def test_zero_steps_returns_the_data():
    ppca = _ppca()
    x = ppca.sample(3)
    chain = gibbs(ppca.model, x, block_size=2, num_steps=0)
    assert chain.shape == (1, 3, 4) and torch.equal(chain[0], x)
