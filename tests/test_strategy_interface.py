"""Every strategy's prepared conditionals offer the whole interface of
:class:`~pyro_mpt.conditionals.SelfPredictive` (``log_prob``, ``log_marginal``, ``sample``,
``diagnostics``), checked against closed forms and grids; and generation uses a strategy
through that interface only: a strategy written here, outside the package, imputes and runs
Gibbs chains."""

import ast
import math
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_mpt import gibbs, impute
from pyro_mpt.conditionals import (
    Auto,
    Conditionals,
    EncodeDecode,
    Exact,
    ImportanceSampling,
    Quadrature,
    SelfPredictive,
)
from pyro_mpt.conditionals.importance_diagnostics import ImportanceDiagnostics
from pyro_mpt.models import PPCA, LinearVAE
from pyro_mpt.trace.model_structure import read_structure
from tests.helpers import dense_schur_log_conditionals

NUM_SE = 4.5
PACKAGE = Path(__file__).resolve().parents[1] / "pyro_mpt"


def _ppca():
    ppca = PPCA(5, 2, init_scale=1.0, noise_scale=0.5)
    ppca.loc = torch.linspace(-1.0, 1.0, 5)
    return ppca


def _schur(cov, loc, x, hidden):
    """Mean and variances of ``x_S | x_R`` under ``N(loc, cov)`` by the dense Schur
    complement."""
    s, r = hidden.nonzero().squeeze(-1), (~hidden).nonzero().squeeze(-1)
    gain = cov[s][:, r] @ torch.linalg.inv(cov[r][:, r])
    mean = loc[s] + gain @ (x[r] - loc[r])
    return mean, (cov[s][:, s] - gain @ cov[r][:, s]).diagonal()


@pytest.mark.parametrize("strategy", [Exact(), Auto()], ids=["exact", "auto"])
def test_linear_gaussian_interface_matches_closed_forms(strategy):
    ppca = _ppca()
    x = ppca.sample(3).detach()
    prepared = strategy.prepare(ppca.model, None, (x,), {})
    cov, loc = ppca.covariance().detach(), ppca.loc.detach()
    assert prepared.diagnostics is None
    assert prepared.log_prob_width == 2  # conditioned through the K = 2 latent
    hidden = torch.tensor([[1, 1, 0, 0, 0], [0, 1, 0, 1, 0], [0, 0, 0, 0, 1]], dtype=torch.bool)
    with torch.no_grad():
        log_prob = prepared.log_prob(hidden.unsqueeze(0))[0]
        log_marginal = prepared.log_marginal()
        draws = prepared.sample(hidden, 20000)
    reference = torch.distributions.MultivariateNormal(loc, cov).log_prob(x)
    assert torch.allclose(log_marginal, reference, atol=1e-8)
    assert draws.shape == (20000, 3, 5)
    assert torch.equal(draws[:, ~hidden], x[~hidden].expand(20000, -1))
    for i in range(3):
        for j, value in dense_schur_log_conditionals(x[i], loc, cov, hidden[i]).items():
            assert torch.allclose(log_prob[i, j], value, atol=1e-8)
        mean, var = _schur(cov, loc, x[i], hidden[i])
        sample = draws[:, i][:, hidden[i]]
        assert ((sample.mean(0) - mean).abs() <= NUM_SE * (var / 20000).sqrt()).all()
        assert ((sample.var(0) - var).abs() <= NUM_SE * var * math.sqrt(2 / 20000)).all()


LOADING = torch.tensor([2.5, 2.0, -1.5, 1.0])
BIAS = torch.tensor([0.0, 0.5, -0.5, 0.3])


def _bernoulli_model(x):
    with pyro.plate("data", x.shape[0]):
        z = pyro.sample("z", dist.Normal(0.0, 1.0))
        logits = z.unsqueeze(-1) * LOADING + BIAS
        pyro.sample("x", dist.Bernoulli(logits=logits).to_event(1), obs=x)


def _grid(x):
    """``log p(x)`` and ``p(x_j = 1 | x_R)`` of each observation and feature (``R`` all
    the other features), by a fine trapezoid grid over the latent."""
    z = torch.linspace(-9.0, 9.0, 8001)
    fn = dist.Bernoulli(logits=z.unsqueeze(-1) * LOADING + BIAS)
    log_prior = dist.Normal(0.0, 1.0).log_prob(z)
    log_marginal, one = [], []
    for row in x:
        ll = fn.log_prob(row)  # (Z, D)
        log_joint = log_prior + ll.sum(-1)
        log_marginal.append(torch.trapezoid(log_joint.exp(), z).log())
        context = (log_prior.unsqueeze(-1) + ll.sum(-1, keepdim=True) - ll).exp()  # (Z, D)
        p1 = torch.trapezoid(context * fn.probs, z, dim=0) / torch.trapezoid(context, z, dim=0)
        one.append(p1)
    return torch.stack(log_marginal), torch.stack(one)


def test_quadrature_interface_matches_grid():
    x = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    prepared = Quadrature(num_points=60).prepare(_bernoulli_model, None, (x,), {})
    # Built whole by the constructor: the rule's nodes and latent dimension.
    assert prepared.latent_dim == 1 and prepared.nodes.shape == (60, 1)
    assert prepared.log_prob_width == 60  # each conditional sums over the 60 nodes
    assert prepared.diagnostics is None
    log_marginal, one = _grid(x)
    hidden = torch.eye(4, dtype=torch.bool)[[0, 2]]  # feature 0 of the first, 2 of the second
    n = 20000
    with torch.no_grad():
        assert torch.allclose(prepared.log_marginal(), log_marginal, atol=1e-6)
        log_prob = prepared.log_prob(hidden.unsqueeze(0))[0]
        draws = prepared.sample(hidden, n)
    assert torch.equal(draws[:, ~hidden], x[~hidden].expand(n, -1))
    for i, j in [(0, 0), (1, 2)]:
        p = one[i, j]
        expected = p if x[i, j] == 1 else 1 - p
        assert torch.allclose(log_prob[i, j].exp(), expected, atol=1e-6)
        freq = draws[:, i, j].mean()
        assert abs(freq - p) <= NUM_SE * math.sqrt(p * (1 - p) / n)


def test_importance_interface_against_closed_forms():
    # Loadings small beside the noise: the prior proposes well for every context.
    ppca = PPCA(5, 2, init_scale=0.5, noise_scale=1.0)
    ppca.loc = torch.linspace(-1.0, 1.0, 5)
    x = ppca.sample(2).detach()
    cov, loc = ppca.covariance().detach(), ppca.loc.detach()
    hidden = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    # Zero encoder weights: q(z | x) is the prior, a broad proposal.
    prepared = ImportanceSampling(num_samples=200).prepare(ppca.model, ppca.guide, (x,), {})
    assert prepared.log_prob_width == 200  # each conditional weights 200 draws
    with torch.no_grad():
        assert prepared.diagnostics is None  # nothing estimated yet
        log_prob = prepared.log_prob(hidden.unsqueeze(0))
        assert log_prob.shape == (1, 2, 5) and torch.isfinite(log_prob).all()
        assert isinstance(prepared.diagnostics, ImportanceDiagnostics)
        assert prepared.diagnostics.pareto_k.shape == (1, 2)
    # exp(log_marginal) is the mean of S importance weights: unbiased for p(x). Each
    # observation repeated 100 times gives 100 independent estimates in one call.
    repeated = ImportanceSampling(num_samples=200).prepare(
        ppca.model, ppca.guide, (x.repeat(100, 1),), {}
    )
    with torch.no_grad():
        estimates = repeated.log_marginal().exp().reshape(100, 2)
    reference = torch.distributions.MultivariateNormal(loc, cov).log_prob(x).exp()
    se = estimates.std(0) / math.sqrt(100)
    assert ((estimates.mean(0) - reference).abs() <= NUM_SE * se).all()
    n = 2000
    prepared = ImportanceSampling(num_samples=1000).prepare(ppca.model, ppca.guide, (x,), {})
    with torch.no_grad():
        draws = prepared.sample(hidden, n)
    assert torch.equal(draws[:, ~hidden], x[~hidden].expand(n, -1))
    for i in range(2):
        mean, var = _schur(cov, loc, x[i], hidden[i])
        # Resampling 1000 proposals adds a little bias and duplicates: a looser bound.
        se = (var / n).sqrt()
        assert ((draws[:, i][:, hidden[i]].mean(0) - mean).abs() <= 2 * NUM_SE * se).all()


def test_encode_decode_interface():
    vae = LinearVAE(4, 2)
    x = torch.bernoulli(torch.full((3, 4), 0.5))
    prepared = EncodeDecode(num_iterations=2).prepare(vae.model, vae.guide, (x,), {})
    assert prepared.diagnostics is None
    assert prepared.log_prob_width == EncodeDecode().num_samples
    hidden = torch.tensor([1, 0, 1, 0], dtype=torch.bool).expand(3, 4)
    with torch.no_grad():
        log_prob = prepared.log_prob(hidden.unsqueeze(0))
        assert log_prob.shape == (1, 3, 4) and torch.isfinite(log_prob).all()
        for joint in (True, False):
            draws = prepared.sample(hidden, 200, joint=joint)
            assert draws.shape == (200, 3, 4)
            assert torch.equal(draws[:, ~hidden], x[~hidden].expand(200, -1))
            assert set(draws[:, hidden].unique().tolist()) == {0.0, 1.0}  # drawn, not means
    with pytest.raises(NotImplementedError, match="EncodeDecodeSelfPredictive gives no log-m"):
        prepared.log_marginal()


# A strategy written outside the package: a fixed Normal predictive N(m_j, s_j) per feature,
# whatever the model's likelihood says, so draws that follow it came through its sample.
FIXED_LOC = torch.tensor([10.0, -5.0, 3.0])
FIXED_SCALE = torch.tensor([0.5, 2.0, 1.0])


class _FixedPredictive(SelfPredictive):
    def log_prob(self, masks):
        value = dist.Normal(FIXED_LOC, FIXED_SCALE).log_prob(self.observed.value)
        return value.expand(masks.shape[:1] + value.shape)

    def log_marginal(self):
        return dist.Normal(FIXED_LOC, FIXED_SCALE).log_prob(self.observed.value).sum(-1)

    def sample(self, hidden, num_samples, joint=True):
        shape = (num_samples,) + tuple(hidden.shape)
        draws = FIXED_LOC + FIXED_SCALE * torch.randn(shape)
        return self.keep_given(hidden, draws)


class _NoDraws(_FixedPredictive):
    sample = SelfPredictive.sample


class _WrongShape(_FixedPredictive):
    def sample(self, hidden, num_samples, joint=True):
        return super().sample(hidden, num_samples, joint)[:, :1]


class _Fixed(Conditionals):
    name = "fixed"

    def __init__(self, prepared_class=_FixedPredictive):
        self.prepared_class = prepared_class

    def prepare(self, model, guide, args, kwargs, max_plate_nesting=math.inf):
        structure = read_structure(model, args, kwargs, max_plate_nesting)
        return self.prepared_class(structure.observed, 1.0)


def _normal_model(x):
    with pyro.plate("data", x.shape[0]):
        pyro.sample("x", dist.Normal(torch.zeros(3), 1.0).to_event(1), obs=x)


def test_impute_and_gibbs_use_a_strategy_through_its_interface():
    n = 4000
    x = torch.zeros(n, 3)
    missing = torch.tensor([True, False, True])
    draws = impute(_normal_model, x, missing=missing, num_samples=1, conditionals=_Fixed())[0]
    assert torch.equal(draws[:, 1], x[:, 1])
    for j in (0, 2):
        se = FIXED_SCALE[j] / math.sqrt(n)
        assert abs(draws[:, j].mean() - FIXED_LOC[j]) <= NUM_SE * se
        var, var_se = FIXED_SCALE[j] ** 2, FIXED_SCALE[j] ** 2 * math.sqrt(2 / n)
        assert abs(draws[:, j].var() - var) <= NUM_SE * var_se
    # One feature per step, each from its fixed predictive: after 60 steps every feature of
    # every chain has been drawn (all but (2/3)^60 of them), so the state follows N(m, s).
    chain = gibbs(_normal_model, x[:1000], block_size=1, num_steps=60, conditionals=_Fixed())
    assert ((chain[1:] != chain[:-1]).sum(-1) <= 1).all()
    last = chain[-1]
    se = FIXED_SCALE / math.sqrt(1000)
    assert ((last.mean(0) - FIXED_LOC).abs() <= NUM_SE * se).all()


def test_strategies_without_draws_or_with_wrong_draws_are_named():
    x = torch.zeros(4, 3)
    missing = torch.tensor([True, False, False])
    with pytest.raises(NotImplementedError, match=r"_NoDraws does not implement sample\("):
        impute(_normal_model, x, missing=missing, conditionals=_Fixed(_NoDraws))
    with pytest.raises(ValueError, match=r"_WrongShape.sample.*shape \(2, 1, 3\).*\(2, 4, 3\)"):
        impute(_normal_model, x, missing=missing, num_samples=2, conditionals=_Fixed(_WrongShape))


def _calls(tree, name):
    """The calls of the builtin ``name`` in a module's syntax tree."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
    ]


STRATEGY_MODULES = {"exact", "quadrature", "quadrature_self_predictive", "importance"}
STRATEGY_MODULES |= {"encode_decode", "likelihood_draws"}


def test_generation_and_curve_do_not_probe_strategy_types():
    for path in sorted((PACKAGE / "generation").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pyro_mpt."):
                parts = node.module.split(".")
                within = parts[1] == "conditionals" and parts[-1] in STRATEGY_MODULES
                assert not within, (path.name, node.module)
        # Type checks only of arguments (integers, booleans), never of conditionals.
        for call in _calls(tree, "isinstance"):
            assert "Predictive" not in ast.unparse(call), (path.name, ast.unparse(call))
    assert not _calls(ast.parse((PACKAGE / "generation" / "draws.py").read_text()), "isinstance")
    for name in ("pyro_curve.py", "coherence.py"):
        diagnostic = ast.parse((PACKAGE / "diagnostics" / name).read_text())
        assert not _calls(diagnostic, "getattr") and not _calls(diagnostic, "isinstance")
