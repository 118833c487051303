"""Models beyond quadrature's reach (a deep Bernoulli VAE, the semi-supervised M2 VAE, a
sparse-gamma DEF, Gaussian mixtures with an amortized classifier, eight schools, ProdLDA)
against independent references of ``log p(x)`` computed in ``experiments/zoo/deep_models.py``.

For each model and strategy (``conditionals="auto"`` and ``ImportanceSampling(num_samples=64)``)
the tests pin one outcome, for the uniform-rate MPT estimate (``MPTLoss.estimate``, mean of
many seeded calls) and for ``log_marginal``:

- **right**: every observation within 4 standard errors plus a stated tolerance;
- **flagged**: an ``ImportanceAccuracyWarning`` whose message gives the Pareto k-hat, and an
  error that really is beyond the tolerance (so the warning is deserved);
- **refused**: a ``ValueError`` naming the observed site.

A wrong answer without the warning fails the test. The measured errors are in the comment
above each table. Over 300 lines because each table of outcomes carries its measurements.
"""

import functools
import re
import warnings

import pytest
import torch

from experiments.zoo import deep_models as deep
from pyro_mpt import MPTLoss, log_marginal
from pyro_mpt.conditionals import Exact, ImportanceSampling, as_conditionals
from pyro_mpt.errors import ImportanceAccuracyWarning

RIGHT, FLAGGED = "right", "flagged"

CASES = {
    "bernoulli_vae": deep.bernoulli_vae,
    "semi_supervised_vae": deep.semi_supervised_vae,
    "sparse_gamma_def": deep.sparse_gamma_def,
    "gaussian_mixture_d1": functools.partial(deep.gaussian_mixture, 1),
    "gaussian_mixture_d4": functools.partial(deep.gaussian_mixture, 4),
    "eight_schools_normal": functools.partial(deep.eight_schools, "normal"),
    "eight_schools_t": functools.partial(deep.eight_schools, "t"),
}

STRATEGIES = {
    "auto": lambda: "auto",
    "importance64": lambda: ImportanceSampling(num_samples=64),
    # Every draw from the guide on the unmasked input, reweighted by every mask: the
    # setting that trains deep VAEs best, held to the same standard.
    "unmasked64": lambda: ImportanceSampling(
        num_samples=64, share_samples=True, num_proposals=0, unmasked_proposal=True
    ),
}

#: Tolerances in nats per observation, on top of 4 standard errors.
#: Exact conditionals make the uniform-rate estimate unbiased, and the closed form is exact.
EXACT_TOL = 1e-8
#: Auto's quadrature rule for the 1-D school effect has converged to 1e-3 nats (the rule
#: it refines against agrees to that), so 1e-2 covers its bias.
QUADRATURE_TOL = 1e-2
#: ImportanceSampling with 64 samples and a proposal whose ESS is near 64 (the eight schools: the
#: AutoNormal posterior is close to every p(theta | y_R)) has a ratio bias of order
#: (1/ESS - 1/S) / 2 per log-mean-exp term, hundredths of a nat summed over D = 4 features;
#: a tenth of a nat covers it. The same bound serves as the size an error must pass to be
#: called wrong.
IMPORTANCE_TOL = 0.1
#: IWAE bounds with 64 samples of an encoder fitted to the full data sit below log p(x) by
#: about (S/ESS - 1) / (2S): a few hundredths of a nat for the VAEs and the eight schools.
IWAE_TOL = 0.1

#: Calls averaged per MPT estimate. The small models' estimates are heavy-tailed across
#: masks (in the mixtures a rare mask whose proposal misses the component costs nats; the
#: schools' outlying scores swing with the mask), and they are cheap, so they take more: at
#: 40 calls one school's SE understated its spread by half.
NUM_DRAWS = {
    "gaussian_mixture_d1": 120,
    "gaussian_mixture_d4": 120,
    "eight_schools_normal": 200,
    "eight_schools_t": 200,
}
DEFAULT_DRAWS = 40
NUM_LOG_MARGINAL_DRAWS = 20

_KHAT = re.compile(r"(?i)(k-hat|khat|k̂|pareto k)")


@functools.cache
def _case(name):
    return CASES[name]()


#: Fresh model functions, kept alive so that no two tests share one's identity.
_FRESH = []


def _fresh(model):
    """A new function calling ``model``: pyro_mpt warns once per model function and
    argument shapes, so each test gets a model of its own and sees its own warnings,
    whatever ran before it in the process."""

    @functools.wraps(model)
    def fresh(*args, **kwargs):
        return model(*args, **kwargs)

    _FRESH.append(fresh)
    return fresh


def _tolerance(chosen, importance_tol):
    """The tolerance of the strategy auto chose (or was given)."""
    if isinstance(chosen, Exact):
        return EXACT_TOL
    if isinstance(chosen, ImportanceSampling):
        return importance_tol
    return QUADRATURE_TOL


def _mpt_draws(case, model, conditionals, num_draws):
    """``num_draws`` uniform-rate MPT estimates per observation (``num_masks=D`` stratifies
    the mask sizes), the warnings they raised, and the strategy used."""
    loss = MPTLoss(rate="uniform", num_masks=case.data.shape[-1], conditionals=conditionals)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        draws = torch.stack(
            [loss.estimate(model, case.guide, *case.args) for _ in range(num_draws)]
        )
    chosen = getattr(loss.conditionals, "chosen", None) or loss.conditionals
    return draws, caught, chosen


def _log_marginal_draws(case, model, conditionals, num_draws):
    """``num_draws`` calls of ``log_marginal`` with one strategy object (auto searches once),
    the warnings they raised, and the strategy used."""
    conditionals = as_conditionals(conditionals)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        draws = torch.stack(
            [
                log_marginal(model, *case.args, guide=case.guide, conditionals=conditionals)
                for _ in range(num_draws)
            ]
        )
    chosen = getattr(conditionals, "chosen", None) or conditionals
    return draws, caught, chosen


def _errors(draws, reference):
    """Per observation: the error of the mean of the draws and its standard error (the
    draws' and the reference's, combined)."""
    error = draws.mean(0) - reference.value
    se = (draws.var(0) / draws.shape[0] + reference.se**2).sqrt()
    return error, se


def _describe(error, se):
    worst = int((error.abs() - 4 * se).argmax())
    return (
        f"mean error {float(error.mean()):+.3f} nats per observation; worst observation {worst}: "
        f"{float(error[worst]):+.3f} +- {float(se[worst]):.3f}; all: {error.numpy().round(2)}"
    )


def _assert_right(error, se, tol, what):
    assert bool((error.abs() <= 4 * se + tol).all()), (
        f"{what} is wrong beyond 4 SE + {tol} nats: {_describe(error, se)}"
    )


def _khat_figure(message):
    """The k-hat figures a warning states: the numbers in the clause that names k-hat (up to
    the next ';' or full stop), other than the 0.7 threshold."""
    match = _KHAT.search(message)
    if match is None:
        return []
    clause = re.split(r";|\.\s", message[match.end() :])[0]
    return [float(n) for n in re.findall(r"-?\d+\.\d+", clause) if float(n) != 0.7]


def _assert_flagged(error, se, caught, tol, what):
    accuracy = [w for w in caught if issubclass(w.category, ImportanceAccuracyWarning)]
    assert accuracy, (
        f"{what} is silently wrong (no ImportanceAccuracyWarning): {_describe(error, se)}"
    )
    messages = [str(w.message) for w in accuracy]
    assert any(_khat_figure(m) for m in messages), f"no k-hat figure in {messages}"
    assert bool((error.abs() > 4 * se + tol).any()), (
        f"{what} warned, but is within 4 SE + {tol} nats everywhere: {_describe(error, se)}"
    )


# --------------------------------------------------------------------------------------
# The references themselves.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case_name", list(CASES))
def test_reference_is_trustworthy(case_name):
    """Sampled references have bounded weights (k-hat below 0.7) and small standard errors;
    the IWAE bound with the encoder and many samples agrees with them (VAE, M2)."""
    case = _case(case_name)
    reference = case.reference
    assert reference.value.shape == case.data.shape[:-1]
    assert bool(reference.value.isfinite().all())
    if reference.khat is not None:
        assert bool((reference.khat < 0.7).all()), reference.khat
    assert bool((reference.se < 0.05).all()), reference.se
    if case.iwae is not None:
        # The IWAE bound with the encoder itself and as many samples, from another proposal:
        # a lower bound in expectation, tight with an encoder trained on these data. Its
        # weights are heavier-tailed than the reference's (k-hat up to 0.8), so its standard
        # error understates its spread: the two must agree to a tenth of a nat.
        gap = case.iwae.value - reference.value
        assert bool((gap.abs() <= 0.1).all()), gap


# --------------------------------------------------------------------------------------
# The uniform-rate MPT estimate.
#
# Measured on this tree (mean of the calls set in NUM_DRAWS; error = mean - reference, nats
# per observation: mean over the 8 observations, and the largest with its SE). Auto chose
# ImportanceSampling(64) for the first five models, Exact and Quadrature(20) for the schools.
#
#   model                  error: mean; largest +- SE     auto            importance64
#   bernoulli_vae          -1.05;  -3.70 +- 0.22          silent          silent
#   semi_supervised_vae    -0.42;  -1.47 +- 0.30          silent          silent
#   sparse_gamma_def       +2.44;  +4.78 +- 0.22          warned (k-hat)  silent
#   gaussian_mixture_d1    -2.40; -10.04 +- 0.05          silent          silent
#   gaussian_mixture_d4    -0.72;  -3.30 +- 0.68          silent          silent
#   eight_schools_normal   auto -0.02; -0.06 +- 0.03      right;  importance64 -0.02;
#                          -0.17 +- 0.09, right
#   eight_schools_t        auto -0.02; -0.06 +- 0.03      right;  importance64 -0.02;
#                          -0.13 +- 0.07, right
#
# The deep models' errors come from proposals that miss p(z | x_R): the encoder reads the
# zero-filled masked entries as observed zeros (VAE: median k-hat 0.60, 36% of rows above
# 0.7, past the 20% share that flags a batch). In the mixtures q(c | x_fill) put no mass on
# the component an observation belongs to, and no sample landed there: -2.40 and -0.72 nats
# on average, up to 10 nats, with healthy-looking weights. Proposals for discrete latents
# are now mixed with a uniform choice (pyro_mpt.trace.defensive_proposal), which makes the
# mixtures right: with 300 calls, errors within -0.07 +- 0.03 (D = 1) and -0.10 +- 0.06
# (D = 4), median ESS 25 and 50 of 64.
# --------------------------------------------------------------------------------------

# "unmasked64" draws every sample from the guide on the unmasked input: the draws propose
# for p(z | x), not for the posteriors of the masks that hide most, so the deep models'
# estimates are off further than with masked proposals (the semi-supervised VAE by +0.40
# nats per observation on average, up to +0.71) and flagged; the small models stay right.
MPT_EXPECTED = [
    ("bernoulli_vae", "auto", FLAGGED),
    ("bernoulli_vae", "importance64", FLAGGED),
    ("semi_supervised_vae", "auto", FLAGGED),
    ("semi_supervised_vae", "importance64", FLAGGED),
    ("sparse_gamma_def", "auto", FLAGGED),
    ("sparse_gamma_def", "importance64", FLAGGED),
    ("gaussian_mixture_d1", "auto", RIGHT),
    ("gaussian_mixture_d1", "importance64", RIGHT),
    ("gaussian_mixture_d4", "auto", RIGHT),
    ("gaussian_mixture_d4", "importance64", RIGHT),
    ("eight_schools_normal", "auto", RIGHT),
    ("eight_schools_normal", "importance64", RIGHT),
    ("eight_schools_t", "auto", RIGHT),
    ("eight_schools_t", "importance64", RIGHT),
    ("bernoulli_vae", "unmasked64", FLAGGED),
    ("semi_supervised_vae", "unmasked64", FLAGGED),
    ("sparse_gamma_def", "unmasked64", FLAGGED),
    ("gaussian_mixture_d1", "unmasked64", RIGHT),
    ("gaussian_mixture_d4", "unmasked64", RIGHT),
    ("eight_schools_normal", "unmasked64", RIGHT),
    ("eight_schools_t", "unmasked64", RIGHT),
]


@pytest.mark.parametrize(
    "case_name, strategy_name, outcome",
    MPT_EXPECTED,
    ids=[f"{c}-{s}" for c, s, _ in MPT_EXPECTED],
)
def test_uniform_mpt_estimate_is_right_or_flagged(case_name, strategy_name, outcome):
    """The mean of many uniform-rate MPT estimates is the reference's ``log p(x)`` within its
    strategy's tolerance, or an ImportanceAccuracyWarning says it cannot be trusted."""
    case = _case(case_name)
    case.restore()
    model = _fresh(case.model)
    num_draws = NUM_DRAWS.get(case_name, DEFAULT_DRAWS)
    draws, caught, chosen = _mpt_draws(case, model, STRATEGIES[strategy_name](), num_draws)
    error, se = _errors(draws, case.reference)
    what = f"MPTLoss(rate='uniform').estimate under {chosen!r}"
    if outcome == RIGHT:
        _assert_right(error, se, _tolerance(chosen, IMPORTANCE_TOL), what)
    else:
        _assert_flagged(error, se, caught, IMPORTANCE_TOL, what)


def test_auto_integrates_the_gaussian_school_effects_exactly():
    """Eight schools with a Gaussian likelihood is linear-Gaussian: auto must take the exact
    path, whose conditionals need no samples."""
    case = _case("eight_schools_normal")
    case.restore()
    loss = MPTLoss(rate="uniform", num_masks=4, conditionals="auto")
    with torch.no_grad():
        loss.estimate(case.model, case.guide, *case.args)
    assert isinstance(loss.conditionals.chosen, Exact), loss.conditionals.chosen


# --------------------------------------------------------------------------------------
# log_marginal.
#
# Measured on this tree (mean of 20 calls; nats per observation; auto and importance64 chose
# the same strategies as above and gave the same numbers):
#
#   model                  error: mean; largest +- SE     warning
#   bernoulli_vae          -0.023; -0.052 +- 0.021        none                right
#   semi_supervised_vae    -0.002; -0.020 +- 0.016        none                right
#   sparse_gamma_def       -2.97;  -4.23  +- 0.10         auto only (k-hat)   flagged
#   gaussian_mixture_d1    +0.001; +0.003 +- 0.001        none                right
#   gaussian_mixture_d4    -0.000; -0.001 +- 0.001        none                right
#   eight_schools_normal   exact 0 (1e-12); importance64 -0.001; -0.006 +- 0.004   right
#   eight_schools_t        quadrature 0 (1e-4); importance64 as above              right
#
# (The "warning" column was measured before the 20%-share threshold: with it, a batch of 8
# where 2 rows pass k-hat 0.7 warns too, e.g. the Bernoulli VAE, while the value is right;
# a right value with a warning passes these tests.)
# With the full data the encoders propose well (IWAE with 64 samples is within hundredths);
# the DEF's AutoNormal does not (its weights have k-hat near 1 even with every count seen).
# --------------------------------------------------------------------------------------

LOG_MARGINAL_EXPECTED = [
    ("bernoulli_vae", "auto", RIGHT),
    ("bernoulli_vae", "importance64", RIGHT),
    ("semi_supervised_vae", "auto", RIGHT),
    ("semi_supervised_vae", "importance64", RIGHT),
    ("sparse_gamma_def", "auto", FLAGGED),
    ("sparse_gamma_def", "importance64", FLAGGED),
    ("gaussian_mixture_d1", "auto", RIGHT),
    ("gaussian_mixture_d1", "importance64", RIGHT),
    ("gaussian_mixture_d4", "auto", RIGHT),
    ("gaussian_mixture_d4", "importance64", RIGHT),
    ("eight_schools_normal", "auto", RIGHT),
    ("eight_schools_normal", "importance64", RIGHT),
    ("eight_schools_t", "auto", RIGHT),
    ("eight_schools_t", "importance64", RIGHT),
]


@pytest.mark.parametrize(
    "case_name, strategy_name, outcome",
    LOG_MARGINAL_EXPECTED,
    ids=[f"{c}-{s}" for c, s, _ in LOG_MARGINAL_EXPECTED],
)
def test_log_marginal_is_right_or_flagged(case_name, strategy_name, outcome):
    """``log_marginal`` is the reference within its strategy's tolerance, or an
    ImportanceAccuracyWarning says it cannot be trusted."""
    case = _case(case_name)
    case.restore()
    model = _fresh(case.model)
    draws, caught, chosen = _log_marginal_draws(
        case, model, STRATEGIES[strategy_name](), NUM_LOG_MARGINAL_DRAWS
    )
    error, se = _errors(draws, case.reference)
    what = f"log_marginal under {chosen!r}"
    if outcome == RIGHT:
        # ImportanceSampling gives the IWAE bound on the full data, below log p(x) by its gap.
        _assert_right(error, se, _tolerance(chosen, IWAE_TOL), what)
    else:
        _assert_flagged(error, se, caught, IMPORTANCE_TOL, what)


# --------------------------------------------------------------------------------------
# ProdLDA: a decoder normalised over dim=1 is refused by name.
# --------------------------------------------------------------------------------------

#: The error must name the observed site; a run with extra batch dims left of the
#: documents normalises over the wrong dim, so every conditional would be silently wrong.
_NAMES_OBS_SITE = r"(?s)site\b.*'obs'|'obs'.*\bsite"


@pytest.mark.parametrize("strategy_name", list(STRATEGIES))
def test_prodlda_softmax_over_dim_1_is_refused_by_site(strategy_name):
    """A decoder that normalises over dim=1 mixes the samples' or masks' dim into each
    document's word probabilities once extra dims sit on the left: refused, naming 'obs'."""
    case = _case_prodlda(softmax_dim=1)
    model = _fresh(case.model)
    loss = MPTLoss(rate="uniform", conditionals=STRATEGIES[strategy_name]())
    with pytest.raises(ValueError, match=_NAMES_OBS_SITE):
        loss.estimate(model, case.guide, *case.args)
    with pytest.raises(ValueError, match=_NAMES_OBS_SITE):
        log_marginal(model, *case.args, guide=case.guide, conditionals=STRATEGIES[strategy_name]())


@pytest.mark.parametrize("strategy_name", list(STRATEGIES))
def test_prodlda_softmax_over_the_last_dim_is_scored(strategy_name):
    """The same model with ``softmax(..., dim=-1)`` broadcasts and is scored, so the refusal
    above is about the dim, not about ProdLDA: a finite estimate for every document."""
    case = _case_prodlda(softmax_dim=-1)
    model = _fresh(case.model)
    loss = MPTLoss(rate="uniform", conditionals=STRATEGIES[strategy_name]())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ImportanceAccuracyWarning)  # untrained encoder
        with torch.no_grad():
            estimate = loss.estimate(model, case.guide, *case.args)
    assert estimate.shape == case.data.shape[:-1]
    assert bool(estimate.isfinite().all())


def _case_prodlda(softmax_dim):
    case = deep.prodlda(softmax_dim)
    case.restore()
    return case
