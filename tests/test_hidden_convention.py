"""Guides that declare ``hidden``: which entries each strategy says are hidden, guides
without it, and the accuracy a mask-aware proposal buys (an oracle posterior makes every
importance weight equal at any number of samples, the same guide blind to the mask does not).

Over 300 lines because it covers the convention end to end: what importance, encode-decode
and imputation pass, which guides get it, the accuracy against closed forms, and the VAE
encoders that use it.
"""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule

from pyro_mpt import impute
from pyro_mpt.conditionals import EncodeDecode, ImportanceSampling
from pyro_mpt.models import VAE, LinearVAE
from pyro_mpt.ops.self_normalised_importance import fill_masked
from pyro_mpt.trace.guided_model import run_guided
from tests.helpers import dense_schur_log_conditionals

N, D = 6, 5
NESTING = 2  # the data plate and the feature plate


def _params():
    """Loadings, offsets and noise scales of the 1-D latent linear-Gaussian model."""
    w = torch.tensor([1.2, -0.7, 0.5, 2.0, -1.5])
    b = torch.tensor([0.3, -0.2, 0.0, 0.5, 0.1])
    s = torch.tensor([0.6, 0.4, 0.9, 0.5, 0.7])
    return w, b, s


def model(x, observed=None):
    """``z ~ N(0, 1)``, ``x_j ~ N(w_j z + b_j, s_j^2)``; ``observed`` marks missing entries."""
    w, b, s = _params()
    with pyro.plate("data", x.shape[-2], dim=-2):
        z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0))  # (..., N, 1)
        with pyro.plate("features", x.shape[-1], dim=-1):
            fn = dist.Normal(w * z + b, s)
            pyro.sample("x", fn if observed is None else fn.mask(observed), obs=x)


def _posterior_guide(x, seen):
    """Samples ``z`` from the exact posterior ``p(z | x_seen)`` of :func:`model`."""
    w, b, s = _params()
    precision = 1.0 + (seen * w**2 / s**2).sum(-1, keepdim=True)
    mean = (seen * w * (x - b) / s**2).sum(-1, keepdim=True) / precision
    with pyro.plate("data", x.shape[-2], dim=-2):
        pyro.sample("z", dist.Normal(mean, precision.rsqrt()))


def oracle(x, observed=None, hidden=None):
    """The exact posterior given the entries that are not hidden (all, for ``None``)."""
    if hidden is None:
        seen = torch.ones_like(x) if observed is None else observed.to(x.dtype)
    else:
        seen = (~hidden).to(x.dtype)
    _posterior_guide(x, seen)


def blind_oracle(x, observed=None):
    """The same posterior, reading every entry it is given as observed."""
    _posterior_guide(x, torch.ones_like(x) if observed is None else observed.to(x.dtype))


class Recorder:
    """A guide that records the data and ``hidden`` of each call, and proposes from the
    exact posterior given the entries that are not hidden."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, observed=None, hidden=None):
        self.calls.append((x.detach().clone(), None if hidden is None else hidden.clone()))
        oracle(x, observed, hidden)


class ReadingRecorder(Recorder):
    """A :class:`Recorder` whose proposal reads the hidden entries' values too, so that
    encode-decode's refills reach it (a guide that ignores them has its refills skipped)."""

    def __call__(self, x, observed=None, hidden=None):
        self.calls.append((x.detach().clone(), None if hidden is None else hidden.clone()))
        oracle(x, observed, None)


def _data(seed=1):
    """Draws of the model, ``(N, D)``, and a pattern of missing entries."""
    torch.manual_seed(seed)
    w, b, s = _params()
    x = torch.randn(N, 1) * w + b + s * torch.randn(N, D)
    observed = torch.rand(N, D) > 0.3
    observed[0] = True  # one complete observation
    return x, observed


def _masks(num_masks=3, seed=2):
    torch.manual_seed(seed)
    masks = torch.rand(num_masks, N, D) < 0.4
    masks[:, :, 0] = True  # at least one masked feature per observation and mask
    return masks


def _expected_data(x, hidden):
    """``x`` with its hidden entries zero-filled, broadcast like ``hidden``."""
    return torch.where(hidden, torch.zeros(()), x)


def test_importance_tells_the_guide_the_masked_and_missing_entries():
    x, observed = _data()
    masks = _masks()
    guide = Recorder()
    prepared = ImportanceSampling(num_samples=3).prepare(model, guide, (x, observed), {}, NESTING)
    assert prepared.guided.takes_hidden
    # The check run at preparation hides nothing.
    assert all(not h.any() for _, h in guide.calls)
    guide.calls.clear()
    prepared.log_prob(masks)
    ((data, hidden),) = guide.calls
    expected = masks | ~observed
    assert hidden.dtype == torch.bool and hidden.shape == data.shape == (3, N, D)
    assert torch.equal(hidden, expected)
    assert torch.equal(data, _expected_data(x, expected))

    guide.calls.clear()
    prepared.log_marginal()
    ((data, hidden),) = guide.calls
    assert torch.equal(hidden, (~observed).unsqueeze(0))
    assert torch.equal(data, _expected_data(x, ~observed).unsqueeze(0))


def test_masks_shared_across_the_batch_reach_the_guide_broadcast():
    x, _ = _data()
    masks = _masks()[:, :1]  # (P, 1, D): one mask for the whole batch
    guide = Recorder()
    prepared = ImportanceSampling(num_samples=2).prepare(model, guide, (x,), {}, NESTING)
    guide.calls.clear()
    prepared.log_prob(masks)
    ((data, hidden),) = guide.calls
    assert hidden.shape == (3, N, D)
    assert torch.equal(hidden, masks.expand(3, N, D))


def test_encode_decode_tells_the_guide_at_every_iteration():
    x, observed = _data()
    masks = _masks()
    guide = ReadingRecorder()
    strategy = EncodeDecode(num_iterations=2, num_samples=4)
    prepared = strategy.prepare(model, guide, (x, observed), {}, NESTING)
    guide.calls.clear()
    prepared.log_prob(masks)
    assert len(guide.calls) == 3  # two refills and the final encoding
    expected = masks | ~observed
    for i, (data, hidden) in enumerate(guide.calls):
        assert hidden.shape == data.shape == ((3, N, D) if i == 0 else (4, 3, N, D))
        assert torch.equal(hidden, expected.expand(hidden.shape))
        # Visible entries keep the data; hidden ones hold the zero fill, then refills.
        visible = ~expected.expand(data.shape)
        assert torch.equal(data[visible], x.expand(data.shape)[visible])
    assert torch.equal(guide.calls[0][0], _expected_data(x, expected))


@pytest.mark.parametrize(
    "strategy", [ImportanceSampling(num_samples=5), EncodeDecode(num_iterations=2)]
)
def test_imputation_tells_the_guide_the_drawn_and_missing_entries(strategy):
    x, observed = _data()
    missing = _masks(1)[0]
    guide = Recorder()
    draws = impute(
        model,
        x,
        observed,
        missing=missing,
        num_samples=4,
        conditionals=strategy,
        guide=guide,
        max_plate_nesting=NESTING,
    )
    assert draws.shape == (4, N, D)
    expected = missing | ~observed
    # EncodeDecode's first call with a model also probes whether the guide reads hidden
    # entries, hiding every other feature: those calls are not imputation's.
    features = torch.arange(D)
    probes = [features % 2 == parity for parity in (0, 1)]
    calls = [
        (data, hidden)
        for data, hidden in guide.calls
        if hidden.any() and not any(torch.equal(hidden, p.expand(hidden.shape)) for p in probes)
    ]
    # One: encode-decode's refills are skipped for this guide, which ignores hidden values.
    assert len(calls) == 1
    for data, hidden in calls:
        assert torch.equal(hidden, expected.expand(hidden.shape))
        visible = ~expected.expand(data.shape)
        assert torch.equal(data[visible], x.expand(data.shape)[visible])


def test_guides_without_the_parameter_get_no_hidden_argument():
    x, observed = _data()
    masks = _masks()
    seen = []

    def plain(x, observed=None):
        blind_oracle(x, observed)

    def open_kwargs(x, observed=None, **kwargs):
        seen.append(dict(kwargs))
        blind_oracle(x, observed)

    for guide in (plain, open_kwargs):
        prepared = ImportanceSampling(num_samples=3).prepare(
            model, guide, (x, observed), {}, NESTING
        )
        assert not prepared.guided.takes_hidden
        assert torch.isfinite(prepared.log_prob(masks)).all()
    # **kwargs does not count as declaring the parameter: nothing extra is passed.
    assert seen and all(kwargs == {} for kwargs in seen)


def test_an_autoguide_takes_no_hidden_argument_and_works():
    x, _ = _data()
    guide = AutoNormal(model)
    prepared = ImportanceSampling(num_samples=3).prepare(model, guide, (x,), {}, NESTING)
    assert not prepared.guided.takes_hidden
    assert torch.isfinite(prepared.log_prob(_masks())).all()


class ModuleGuide(PyroModule):
    def forward(self, x, observed=None, *, hidden=None):
        oracle(x, observed, hidden)


class CallableGuide:
    def __call__(self, x, observed=None, hidden=None):
        oracle(x, observed, hidden)


class MethodHolder:
    def guide(self, x, observed=None, hidden=None):
        oracle(x, observed, hidden)


def _linear_vae_case():
    vae = LinearVAE(D)
    return vae.model, vae.guide, (vae.sample(N),), 1


@pytest.mark.parametrize(
    "case",
    [
        lambda: (model, ModuleGuide(), _data(), NESTING),
        lambda: (model, CallableGuide(), _data(), NESTING),
        lambda: (model, MethodHolder().guide, _data(), NESTING),
        _linear_vae_case,
    ],
    ids=["module-forward", "callable", "bound-method", "pyro-method"],
)
def test_the_parameter_is_found_on_modules_callables_and_methods(case):
    model_fn, guide, args, nesting = case()
    prepared = ImportanceSampling(num_samples=2).prepare(model_fn, guide, args, {}, nesting)
    assert prepared.guided.takes_hidden


def test_a_hidden_argument_already_given_by_the_call_is_refused():
    x, observed = _data()

    def guide(x, hidden=None):  # the model's second argument would land in `hidden`
        oracle(x, None, hidden)

    with pytest.raises(ValueError, match=r"declares a parameter 'hidden'.*already give"):
        ImportanceSampling().prepare(model, guide, (x, observed), {}, NESTING)


def _reference_conditionals(x, masks):
    """``log p(x_j | x_R)`` by the dense Schur complement of the model's covariance."""
    w, b, s = _params()
    cov = torch.outer(w, w) + torch.diag(s**2)
    out = torch.zeros(masks.shape)
    for p in range(masks.shape[0]):
        for n in range(N):
            for j, value in dense_schur_log_conditionals(x[n], b, cov, masks[p, n]).items():
                out[p, n, j] = value
    return out


@pytest.mark.parametrize("num_samples", [2, 3, 4])
def test_a_mask_aware_oracle_makes_every_weight_equal(num_samples):
    # w(z) = p(z) p(x_R | z) / q(z) is constant in z exactly when q(z) = p(z | x_R): with
    # the oracle told the right entries, all S weights of every (mask, observation) row are
    # equal (effective sample size S) to float precision; read off the zero-filled data,
    # they are not.
    x, observed = _data()
    masks = _masks(4)
    strategy = ImportanceSampling(num_samples=num_samples)
    for args in ((x,), (x, observed)):
        prepared = strategy.prepare(model, oracle, args, {}, NESTING)
        prepared.log_prob(masks)
        ess = prepared.diagnostics.ess
        torch.testing.assert_close(ess, torch.full_like(ess, num_samples), atol=1e-10, rtol=0)
    blind = strategy.prepare(model, blind_oracle, (x,), {}, NESTING)
    blind.log_prob(masks)
    assert (num_samples - blind.diagnostics.ess).min() > 1e-8


def _oracle_standard_errors(x, masks, num_samples):
    """The delta-method standard error of ``log mean_s p(x_j | z_s)`` with ``z_s`` drawn
    from ``p(z | x_R)``: ``sd(p(x_j | z)) / (sqrt(S) p(x_j | x_R))``, both moments in
    closed form (the square of a normal density is a scaled normal density)."""
    w, b, s = _params()
    seen = (~masks).double()
    var = 1.0 / (1.0 + (seen * w**2 / s**2).sum(-1, keepdim=True))
    mean = var * (seen * w * (x - b) / s**2).sum(-1, keepdim=True)
    loc = w * mean + b
    first = dist.Normal(loc, (w**2 * var + s**2).sqrt()).log_prob(x).exp()
    scale = (w**2 * var + s**2 / 2).sqrt()
    second = dist.Normal(loc, scale).log_prob(x).exp() / (2 * torch.pi**0.5 * s)
    return (second - first**2).sqrt() / (num_samples**0.5 * first)


def test_a_mask_aware_oracle_gives_conditionals_within_monte_carlo_error():
    # With q = p(z | x_R) the estimate is log mean_s p(x_j | z_s), z_s ~ p(z | x_R): within
    # a few standard errors of the dense Schur complement. The blind guide is nats off.
    x, _ = _data()
    masks = _masks(4)
    num_samples = 2000
    reference = _reference_conditionals(x, masks)[masks]
    strategy = ImportanceSampling(num_samples=num_samples)
    estimate = strategy.prepare(model, oracle, (x,), {}, NESTING).log_prob(masks)[masks]
    error = _oracle_standard_errors(x, masks, num_samples)[masks]
    assert ((estimate - reference) / error).abs().max() < 4.5
    blind = strategy.prepare(model, blind_oracle, (x,), {}, NESTING).log_prob(masks)[masks]
    assert (blind - reference).abs().max() > 0.5


def test_a_mask_aware_oracle_gives_the_exact_marginal_of_observed_entries():
    x, observed = _data()
    w, b, s = _params()
    cov = torch.outer(w, w) + torch.diag(s**2)
    reference = torch.stack(
        [
            dist.MultivariateNormal(b[o], cov[o][:, o]).log_prob(x[n, o])
            for n, o in enumerate(observed)
        ]
    )
    strategy = ImportanceSampling(num_samples=1)
    estimate = strategy.prepare(model, oracle, (x, observed), {}, NESTING).log_marginal()
    torch.testing.assert_close(estimate, reference, atol=1e-10, rtol=0)


def test_a_mask_aware_oracle_imputes_from_the_exact_conditional():
    # Sampling-importance-resampling with the exact posterior as proposal draws x_S from
    # p(x_S | x_R): the draws' mean is the conditional mean within Monte Carlo error.
    x, _ = _data()
    missing = torch.zeros(N, D, dtype=torch.bool)
    missing[:, 3] = True
    w, b, s = _params()
    cov = torch.outer(w, w) + torch.diag(s**2)
    r = torch.tensor([0, 1, 2, 4])
    gain = cov[3, r] @ torch.linalg.inv(cov[r][:, r])
    mean = b[3] + (x[:, r] - b[r]) @ gain
    sd = (cov[3, 3] - gain @ cov[r, 3]).sqrt()
    num_draws, num_proposals = 2000, 1000
    draws = impute(
        model,
        x,
        missing=missing,
        num_samples=num_draws,
        conditionals=ImportanceSampling(num_samples=num_proposals),
        guide=oracle,
        max_plate_nesting=NESTING,
    )[:, :, 3]
    # Draws resample num_proposals codes: the codes' share of the variance, w_3^2 v with
    # v = Var(z | x_R), enters once per proposal and once per draw.
    between = w[3] ** 2 / (1.0 + (w[r] ** 2 / s[r] ** 2).sum())
    error = (between / num_proposals + sd**2 / num_draws).sqrt()
    assert ((draws.mean(0) - mean) / error).abs().max() < 4.5
    assert torch.allclose(draws.std(0), sd.expand(N), rtol=0.1)


@pytest.mark.parametrize("cls", [LinearVAE, VAE])
def test_vae_encoders_read_the_mask_beside_the_visible_data(cls):
    vae = cls(D, latent_dim=2) if cls is LinearVAE else cls(D, latent_dim=2, hidden_dim=7)
    with torch.no_grad():  # the linear encoder starts at zero; move it off
        for p in vae.parameters():
            p.add_(0.5 * torch.randn_like(p))
    x, _ = _data()
    x[:, 1] = 0.0  # an observed 0 in feature 1 of every observation
    hidden = _masks(1)[0]
    hidden[:, 1] = torch.arange(N) % 2 == 0  # and a hidden feature 1 in every other one
    loc, scale = vae.encode(x, hidden)
    # Hidden entries are not read: changing their values changes nothing.
    other = torch.where(hidden, torch.randn(N, D), x)
    torch.testing.assert_close(vae.encode(other, hidden), (loc, scale), atol=0, rtol=0)
    # A hidden entry is not an observed 0.
    shown = hidden.clone()
    shown[:, 1] = False
    changed = (vae.encode(x, shown)[0] - loc).abs().sum(-1) > 1e-6
    assert torch.equal(changed, hidden[:, 1])
    # hidden=None hides nothing.
    nothing = torch.zeros(N, D, dtype=torch.bool)
    torch.testing.assert_close(vae.encode(x), vae.encode(x, nothing), atol=0, rtol=0)


def test_linear_vae_encoder_is_its_documented_affine_map():
    vae = LinearVAE(D, latent_dim=3)
    with torch.no_grad():
        vae.encoder_weight.copy_(torch.randn(3, 2 * D))
        vae.encoder_bias.copy_(torch.randn(3))
    assert vae.encoder_weight.shape == (3, 2 * D)
    x, _ = _data()
    m = _masks(1)[0]
    a_x, a_m = vae.encoder_weight[:, :D], vae.encoder_weight[:, D:]
    expected = torch.stack(
        [
            a_x @ (x[n] * (1 - m[n].double())) + a_m @ m[n].double() + vae.encoder_bias
            for n in range(N)
        ]
    )
    torch.testing.assert_close(vae.encode(x, m)[0], expected.detach())


@pytest.mark.parametrize("cls", [LinearVAE, VAE])
def test_vae_guide_gets_the_mask_from_the_strategies(cls):
    vae = cls(D, latent_dim=2) if cls is LinearVAE else cls(D, latent_dim=2, hidden_dim=7)
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(0.5 * torch.randn_like(p))
    x = torch.randint(0, 2, (N, D)).double()
    masks = _masks()
    prepared = ImportanceSampling(num_samples=2).prepare(vae.model, vae.guide, (x,), {}, 1)
    assert prepared.guided.takes_hidden
    filled = fill_masked(x, masks)
    trace, _ = run_guided(prepared.guided, filled, 1, False, hidden=masks)
    loc = trace.nodes["z"]["fn"].base_dist.loc
    torch.testing.assert_close(loc, vae.encode(filled, masks)[0].expand(loc.shape))
    assert not torch.allclose(loc, vae.encode(filled)[0].expand(loc.shape))
    assert torch.isfinite(prepared.log_prob(masks)).all()
    with pytest.raises(ValueError, match=r"hidden must broadcast to the shape of x"):
        vae.guide(x, torch.zeros(N, D + 1, dtype=torch.bool))
