"""Quadrature with a latent prior written per observation: equal rows run at the cost of a
shared prior, rows that differ stay per observation, and a run too large for memory is
refused before it allocates. References are brute-force grid integrals over the latent."""

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_mpt import MPTLoss
from pyro_mpt.conditionals import Quadrature
from pyro_mpt.errors import NotApplicableError

N, D, K = 5, 6, 2
LOC, SCALE = 0.3, 1.2
#: Batch shapes (without the latent dim) at which each model ran its decoder, last run last.
DECODER_BATCHES = []


def _weights():
    generator = torch.Generator().manual_seed(1)
    hidden = 0.5 * torch.randn(K, 4, generator=generator, dtype=torch.float64)
    out = torch.randn(4, D, generator=generator, dtype=torch.float64)
    bias = 0.5 * torch.randn(D, generator=generator, dtype=torch.float64)
    return hidden, out, bias


def decode(z):
    """A small fixed nonlinear decoder: the logits of ``D`` pixels, ``z.shape[:-1] + (D,)``."""
    hidden, out, bias = (w.to(z.device) for w in _weights())
    DECODER_BATCHES.append(tuple(z.shape[:-1]))
    return torch.tanh(z @ hidden) @ out + bias


def _observe(z, x):
    pyro.sample("x", dist.Bernoulli(logits=decode(z)).to_event(1), obs=x)


def shared_model(x, c=None):
    with pyro.plate("data", x.shape[-2]):
        prior = dist.Normal(x.new_full((K,), LOC), x.new_full((K,), SCALE))
        _observe(pyro.sample("z", prior.to_event(1)), x)


def per_observation_model(x, c=None):
    """The prior as Pyro's VAE tutorial writes it: one row per observation, all equal."""
    with pyro.plate("data", x.shape[-2]):
        z_loc = x.new_full((x.shape[-2], K), LOC)
        z_scale = x.new_full((x.shape[-2], K), SCALE)
        _observe(pyro.sample("z", dist.Normal(z_loc, z_scale).to_event(1)), x)


def covariate_loc_scale(c):
    return 0.8 * c, 0.6 + 0.6 * torch.sigmoid(c)


def covariate_model(x, c):
    """A prior whose loc and scale depend on a per-observation covariate ``c``, ``(N, K)``."""
    with pyro.plate("data", x.shape[-2]):
        loc, scale = covariate_loc_scale(c)
        _observe(pyro.sample("z", dist.Normal(loc, scale).to_event(1)), x)


def data_loc(x):
    return (4.0 * (x.mean(-1, keepdim=True) - 0.5)).expand(x.shape[:-1] + (K,))


def data_model(x, c=None):
    """A prior whose loc depends on the observation itself."""
    with pyro.plate("data", x.shape[-2]):
        _observe(pyro.sample("z", dist.Normal(data_loc(x), SCALE).to_event(1)), x)


def learned_loc_model(x, loc):
    """A prior loc that needs a gradient, one row per observation (all equal at first)."""
    with pyro.plate("data", x.shape[-2]):
        _observe(pyro.sample("z", dist.Normal(loc, SCALE).to_event(1)), x)


def grid_log_conditionals(x, loc, scale, masks, num=401, half_width=10.0):
    """``log p(x_j | x_R)`` by a Riemann sum over a uniform grid of ``z`` in
    ``[-half_width, half_width]^K``, for each mask ``(P, N, D)``: ``(P, N, D)``."""
    t = torch.linspace(-half_width, half_width, num, dtype=x.dtype)
    z = torch.cartesian_prod(*[t] * K)  # (G, K)
    log_prior = dist.Normal(loc, scale).log_prob(z.unsqueeze(1)).sum(-1)  # (G, N)
    hidden, out, bias = _weights()
    logits = torch.tanh(z @ hidden) @ out + bias  # (G, D)
    ll = dist.Bernoulli(logits=logits.unsqueeze(1)).log_prob(x)  # (G, N, D)
    rows = []
    for mask in masks:
        context = log_prior + (ll * (~mask).to(ll.dtype)).sum(-1)  # (G, N)
        joint = torch.logsumexp(context.unsqueeze(-1) + ll, 0)  # (N, D)
        rows.append(joint - torch.logsumexp(context, 0).unsqueeze(-1))
    return torch.stack(rows)


def _data(seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.rand(N, D, generator=generator) < 0.4).to(torch.float64)
    c = torch.randn(N, K, generator=generator, dtype=torch.float64)
    masks = torch.rand(3, N, D, generator=generator) < 0.5
    masks[..., 0] = True  # every mask hides something
    return x, c, masks


def _quadrature(model, args, masks, num_points=80, rule=None):
    rule = rule or Quadrature(num_points=num_points)
    prepared = rule.prepare(model, None, args, {})
    return prepared.log_prob(masks), prepared


#: Gauss-Hermite with 80 x 80 nodes against a 401 x 401 grid, on this smooth decoder (the
#: rule's error; a prior narrowed wrongly is off by 1e-2 or more).
RULE_TOL = 2e-6


def test_equal_rows_prior_matches_shared_prior_and_grid():
    x, _, masks = _data()
    shared, _ = _quadrature(shared_model, (x,), masks)
    DECODER_BATCHES.clear()
    per_observation, prepared = _quadrature(per_observation_model, (x,), masks)
    # The decoder ran at the 6400 nodes once, shared by every observation: not 6400 N.
    assert DECODER_BATCHES[-1] == (6400, 1)
    assert prepared.logits.shape == (6400, D)
    torch.testing.assert_close(per_observation, shared, rtol=0, atol=1e-12)
    loc, scale = x.new_full((N, K), LOC), x.new_full((N, K), SCALE)
    reference = grid_log_conditionals(x, loc, scale, masks)
    torch.testing.assert_close(per_observation[masks], reference[masks], rtol=0, atol=RULE_TOL)
    torch.testing.assert_close(shared[masks], reference[masks], rtol=0, atol=RULE_TOL)


def test_equal_rows_prior_loss_equals_shared_prior_loss():
    x, _, _ = _data()
    losses = []
    for model in (shared_model, per_observation_model):
        pyro.set_rng_seed(3)
        loss = MPTLoss(conditionals=Quadrature(num_points=30))
        losses.append(loss.loss(model, None, x))
    assert losses[0] == pytest.approx(losses[1], abs=1e-10)


@pytest.mark.parametrize("varying", ["covariate", "data"])
def test_prior_varying_per_observation_matches_grid(varying):
    x, c, masks = _data()
    if varying == "covariate":
        model, (loc, scale) = covariate_model, covariate_loc_scale(c)
    else:
        model, loc, scale = data_model, data_loc(x), x.new_full((N, K), SCALE)
    assert bool((loc != loc[:1]).any())
    DECODER_BATCHES.clear()
    result, _ = _quadrature(model, (x, c), masks)
    assert DECODER_BATCHES[-1] == (6400, N)  # rows that differ are kept
    reference = grid_log_conditionals(x, loc, scale, masks)
    torch.testing.assert_close(result[masks], reference[masks], rtol=0, atol=RULE_TOL)


def test_prior_equal_on_one_call_and_varying_on_the_next():
    """The same call signature may bring rows that differ: they are compared on every
    call, not once per model."""
    x, c, masks = _data()
    rule = Quadrature(num_points=80)
    same_c = c[:1].expand(N, K).clone()
    first, _ = _quadrature(covariate_model, (x, same_c), masks, rule=rule)
    reference = grid_log_conditionals(x, *covariate_loc_scale(same_c), masks)
    torch.testing.assert_close(first[masks], reference[masks], rtol=0, atol=RULE_TOL)
    second, _ = _quadrature(covariate_model, (x, c), masks, rule=rule)
    reference = grid_log_conditionals(x, *covariate_loc_scale(c), masks)
    torch.testing.assert_close(second[masks], reference[masks], rtol=0, atol=RULE_TOL)


def test_prior_rows_that_need_a_gradient_each_get_their_own():
    x, _, masks = _data()
    loc = torch.zeros(N, K, dtype=torch.float64, requires_grad=True)
    result, _ = _quadrature(learned_loc_model, (x, loc), masks)
    (grad,) = torch.autograd.grad(result[masks].sum(), loc)
    reference = grid_log_conditionals(x, loc, x.new_full((N, K), SCALE), masks)
    (expected,) = torch.autograd.grad(reference[masks].sum(), loc)
    assert bool((expected[1:].abs() > 0.1).any())  # rows past the first matter
    torch.testing.assert_close(result[masks], reference[masks].detach(), rtol=0, atol=RULE_TOL)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-4)  # the rule's error


def _learned_decoder_model(x, c=None):
    """The covariate model with a decoder scale in Pyro's param store."""
    gain = pyro.param("gain", lambda: x.new_ones(()))
    with pyro.plate("data", x.shape[-2]):
        loc = (4.0 * (x.mean(-1, keepdim=True) - 0.5)).expand(x.shape[:-1] + (K,))
        z = pyro.sample("z", dist.Normal(loc, 1.0).to_event(1))
        logits = gain * decode(z)
        pyro.sample("x", dist.Bernoulli(logits=logits).to_event(1), obs=x)


def test_memory_estimate_refuses_a_per_observation_run_and_keeps_the_param_store():
    x, _, _ = _data()
    kept = pyro.param("kept", torch.tensor([1.0, 2.0]))
    unconstrained = kept.unconstrained()
    loss = MPTLoss(conditionals=Quadrature(num_points=200, max_memory_gb=1e-3))
    DECODER_BATCHES.clear()
    with pytest.raises(NotApplicableError) as info:
        loss.loss(_learned_decoder_model, None, x)
    message = str(info.value)
    # 40000 nodes x 5 observations x 6 features x 8 bytes x 4 tensors = 0.0384 GB.
    assert "num_points=200" in message
    assert "0.0384 GB" in message and "max_memory_gb=0.001" in message
    assert "num_points=32 fits" in message  # 32**2 * 960 bytes <= 1e6 < 33**2 * 960
    assert "smaller batch" in message and "conditionals='importance'" in message
    # The checks run at 11 slices (5 shared points, 6 that tell the 5 observations apart);
    # the 40000 nodes never ran.
    assert all(batch[0] <= 11 for batch in DECODER_BATCHES)
    store = pyro.get_param_store()
    assert list(store.keys()) == ["kept"]
    assert store.get_param("kept").unconstrained() is unconstrained
    torch.testing.assert_close(store["kept"], torch.tensor([1.0, 2.0]))


def test_memory_estimate_against_available_memory_does_not_allocate():
    """``N = 20000`` observations at 40000 nodes need about 1.3 TB: refused by the default
    limit before the latents at the nodes are formed."""
    generator = torch.Generator().manual_seed(0)
    x = (torch.rand(20000, D, generator=generator) < 0.4).to(torch.float64)
    with pytest.raises(NotApplicableError, match=r"estimated 0\.\d+ GB|estimated [1-9][\d.]* GB"):
        Quadrature(num_points=200).prepare(data_model, None, (x,), {})


def test_memory_estimate_ignores_runs_shared_by_every_observation():
    x, _, masks = _data()
    rule = Quadrature(num_points=200, max_memory_gb=1e-3)
    result, prepared = _quadrature(per_observation_model, (x,), masks, rule=rule)
    assert prepared.logits.shape == (40000, D)
    assert bool(torch.isfinite(result).all())


def test_memory_estimate_covers_a_likelihood_evaluated_per_observation():
    """A Normal likelihood cannot be tabulated: its ``(G, N, D)`` log-likelihoods are
    estimated though the decoder ran once per node."""
    x, _, _ = _data()

    def normal_model(x):
        with pyro.plate("data", x.shape[-2]):
            z = pyro.sample("z", dist.Normal(x.new_zeros(x.shape[-2], K), 1.0).to_event(1))
            pyro.sample("x", dist.Normal(decode(z), 1.0).to_event(1), obs=x)

    with pytest.raises(NotApplicableError, match="num_points=200"):
        Quadrature(num_points=200, max_memory_gb=1e-3).prepare(normal_model, None, (x,), {})
    assert Quadrature(num_points=200, max_memory_gb=1.0).prepare(normal_model, None, (x,), {})


@pytest.mark.parametrize("value", [0, -1.0, True, "8"])
def test_max_memory_gb_must_be_positive(value):
    with pytest.raises(ValueError, match=f"max_memory_gb must be a positive number.*{value!r}"):
        Quadrature(max_memory_gb=value)
