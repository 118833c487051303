"""Models beyond quadrature's reach through ``MPTLoss(conditionals="auto")``: the strategy
auto chose, the error per observation of the uniform-rate MPT estimate against an
independent reference of ``log p(x)``, and whether an ``ImportanceAccuracyWarning`` said so
or the model was refused.

Sections:

* ``pyro-vae z=50``: the VAE of Pyro's ``examples/vae/vae.py``, written the same way
  (encoder and decoder MLPs of 400 softplus units, a 50-D latent, a Bernoulli decoder with
  sigmoid probabilities, plates sized by ``x.shape[-2]``) with the example's encoder as
  guide (it reads the whole image: it cannot tell a hidden pixel from a dark one), trained
  briefly by ``Trace_ELBO`` on binarised digits of :func:`pyro_mpt.datasets.load_mnist`.
  Reference: importance sampling, float64, from a multivariate Student-t centred at each
  image's posterior mode (L-BFGS) with the inverse Gauss-Newton curvature (a Laplace
  approximation), widened; its standard error and its weights' Pareto k-hat are reported.
  The MPT estimates run in float32 (``num_masks=D`` at D=784 is 64 x 784 latents per image;
  float64 is 2.5 times slower): ``dtype_gap`` in the JSON is the largest difference between
  the float32 and float64 models' ``log p(x | z)`` at posterior draws. Also the time of one
  ``SVI`` step with ``MPTLoss()`` against one with ``Trace_ELBO`` (median of ``--repeats``).
  The example's encoder also reshapes its input to ``(-1, 784)``; that variant is a row of
  its own, which must be refused.
* ``pyro-vae z=2``: the same VAE with a 2-D latent, float64; reference: the trapezoid rule
  on a dense grid over the region where a coarse grid over ``[-8, 8]^2`` finds the posterior
  (and a coarser rule on that region, whose difference is reported).
* the models of ``experiments/zoo/deep_models.py`` with the references the tests use, float64.
* ``trained by MPT``: a deep Bernoulli VAE (:class:`pyro_mpt.models.VAE`, K=8, 128 hidden
  units, an encoder that sees which pixels are hidden) trained by
  ``MPTLoss(conditionals="auto")`` and, from the same start and batches, by ``Trace_ELBO``;
  each one's objective per image on training images at the end against ``log p(x)`` of
  the same images and of held-out ones (the Laplace-t reference above).
* ``log_marginal`` with a guide whose parameters are sized by the data: Pyro's param store
  afterwards, and a ``Trace_ELBO`` step on data of another size.

Errors are ``mean of the draws - reference`` per observation, in nats; the SE combines the
draws' spread and the reference's SE. ``verdict``: ``right`` if every observation is within
4 SE plus the strategy's tolerance (exact 1e-8, quadrature 1e-2, importance 0.1 nats, as in
``tests/test_models_beyond_quadrature.py``), else ``flagged`` when a warning was raised and
``SILENTLY OFF`` when not.

Usage::

    python benchmarks/beyond_quadrature_table.py [--smoke] [--threads N] [--json PATH]

Runs on one thread unless ``--threads`` is given, on the CPU only. Without ``--json`` the
figures are written to ``results/beyond_quadrature.json`` (ignored by git).
"""

import copy
import functools
import logging
import math
import pathlib
import statistics
import sys
import time
import warnings

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.infer import SVI, Trace_ELBO
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # experiments.zoo

from _common import (  # noqa: E402
    benchmark_main,
    constants,
    make_report,
    print_results,
    set_default_dtype,
    time_calls,
)

from experiments.zoo import deep_models as deep  # noqa: E402
from experiments.zoo.references import trapezoid_log_weights  # noqa: E402
from pyro_mpt import MPTLoss, log_marginal  # noqa: E402
from pyro_mpt.conditionals import Exact, ImportanceSampling, as_conditionals  # noqa: E402
from pyro_mpt.datasets import load_mnist  # noqa: E402
from pyro_mpt.errors import ImportanceAccuracyWarning  # noqa: E402
from pyro_mpt.models import VAE  # noqa: E402

__all__ = ["main", "print_report", "run"]

DEFAULT_JSON = pathlib.Path(__file__).resolve().parents[1] / "results" / "beyond_quadrature.json"

# Pyro's example VAE and its data.
PYRO_VAE_HIDDEN = 400
PYRO_VAE_LATENT = 50
NUM_IMAGES = 300
TRAIN_STEPS, BATCH_SIZE, LEARNING_RATE = 300, 100, 1e-3
# Images scored, MPTLoss.estimate calls (num_masks=D each) and log_marginal calls per row.
NUM_SCORED, NUM_CALLS, NUM_LOG_MARGINAL_CALLS = 4, 6, 10
NUM_SCORED_Z2, NUM_CALLS_Z2 = 8, 20
# The Laplace-t reference: samples per image, Student-t degrees of freedom, widening.
REFERENCE_SAMPLES, REFERENCE_DF, REFERENCE_WIDEN = 20_000, 5.0, 1.2
# The 2-D grid: a coarse grid over [-GRID_HALF_WIDTH, GRID_HALF_WIDTH]^2 finds the region
# within GRID_DROP nats of the top; fine and check grids cover it, per image.
GRID_HALF_WIDTH, GRID_COARSE, GRID_FINE, GRID_CHECK, GRID_DROP = 8.0, 241, 101, 71, 40.0
# The tests' draws per model (tests/test_models_beyond_quadrature.py).
DEEP_DRAWS = {
    "gaussian_mixture_d1": 120,
    "gaussian_mixture_d4": 120,
    "eight_schools_normal": 200,
    "eight_schools_t": 200,
}
DEEP_DEFAULT_DRAWS = 40
# Tolerances in nats per observation on top of 4 SE, by strategy (as in the tests).
EXACT_TOL, QUADRATURE_TOL, IMPORTANCE_TOL = 1e-8, 1e-2, 0.1
# The deep VAE trained by MPT.
DEEP_LATENT, DEEP_HIDDEN = 8, 128
DEEP_TRAIN, DEEP_HELD_OUT, DEEP_STEPS, DEEP_LR = 300, 100, 300, 1e-3
DEEP_EVAL_IMAGES, DEEP_EVAL_CALLS, DEEP_REFERENCE_SAMPLES = 100, 20, 2000

SMOKE = dict(
    num_images=100,
    batch_size=20,
    repeats=2,
    train_steps=5,
    num_scored=1,
    num_calls=1,
    num_log_marginal_calls=2,
    num_scored_z2=2,
    num_calls_z2=2,
    reference_samples=500,
    grid_coarse=61,
    grid_fine=31,
    grid_check=21,
    deep_draws=4,
    deep_cases=("eight_schools_normal", "prodlda_softmax_dim1"),
    deep_train=100,
    deep_held_out=20,
    deep_steps=5,
    deep_eval_images=20,
    deep_eval_calls=2,
    deep_reference_samples=200,
)

#: Model functions wrapped by :func:`_fresh`, kept alive so that no two rows share an id.
_FRESH = []


# --------------------------------------------------------------------------------------
# Pyro's example VAE, written as examples/vae/vae.py writes it.
# --------------------------------------------------------------------------------------


class _ExampleEncoder(nn.Module):
    """``q(z | x)``: one softplus layer, then a location and (through exp) a scale. With
    ``flatten`` the input is first reshaped to ``(-1, 784)``, as the example's encoder
    does (one image per row, whatever dims lie to the left)."""

    def __init__(self, z_dim, hidden_dim, x_dim=784, flatten=False):
        super().__init__()
        self.fc1 = nn.Linear(x_dim, hidden_dim)
        self.fc21 = nn.Linear(hidden_dim, z_dim)
        self.fc22 = nn.Linear(hidden_dim, z_dim)
        self.flatten = flatten

    def forward(self, x):
        if self.flatten:
            x = x.reshape(-1, self.fc1.in_features)
        hidden = F.softplus(self.fc1(x))
        return self.fc21(hidden), torch.exp(self.fc22(hidden))


class _ExampleDecoder(nn.Module):
    """``p(x | z)``: one softplus layer, then a sigmoid per pixel."""

    def __init__(self, z_dim, hidden_dim, x_dim=784):
        super().__init__()
        self.fc1 = nn.Linear(z_dim, hidden_dim)
        self.fc21 = nn.Linear(hidden_dim, x_dim)

    def logits(self, z):
        return self.fc21(F.softplus(self.fc1(z)))

    def forward(self, z):
        return torch.sigmoid(self.logits(z))


class ExampleVAE(nn.Module):
    """The VAE of Pyro's VAE example: ``z ~ N(0, I)``, ``x | z ~ Bernoulli(decoder(z))``,
    guide ``N(encoder(x))``; sites ``"latent"`` and ``"obs"``."""

    def __init__(self, z_dim=PYRO_VAE_LATENT, hidden_dim=PYRO_VAE_HIDDEN, flatten=False):
        super().__init__()
        self.z_dim = z_dim
        self.encoder = _ExampleEncoder(z_dim, hidden_dim, flatten=flatten)
        self.decoder = _ExampleDecoder(z_dim, hidden_dim)

    def model(self, x):
        pyro.module("decoder", self.decoder)
        with pyro.plate("data", x.shape[-2]):
            z_loc = x.new_zeros(x.shape[:-1] + (self.z_dim,))
            z_scale = x.new_ones(x.shape[:-1] + (self.z_dim,))
            z = pyro.sample("latent", dist.Normal(z_loc, z_scale).to_event(1))
            pyro.sample("obs", dist.Bernoulli(self.decoder(z)).to_event(1), obs=x)

    def guide(self, x):
        pyro.module("encoder", self.encoder)
        with pyro.plate("data", x.shape[-2]):
            z_loc, z_scale = self.encoder(x)
            pyro.sample("latent", dist.Normal(z_loc, z_scale).to_event(1))

    def log_likelihood(self, z, x):
        """``log p(x | z)`` as the model scores it (torch's Bernoulli of the probabilities)."""
        return torch.distributions.Bernoulli(self.decoder(z)).log_prob(x).sum(-1)


def _train_elbo(model, guide, x, sizes, seed):
    """Adam steps of ``Trace_ELBO`` on random batches; the last loss per image."""
    svi = SVI(model, guide, pyro.optim.Adam({"lr": LEARNING_RATE}), Trace_ELBO())
    generator = torch.Generator().manual_seed(seed)
    loss = math.nan
    for _ in range(sizes["train_steps"]):
        idx = torch.randint(len(x), (sizes["batch_size"],), generator=generator)
        loss = svi.step(x[idx]) / len(idx)
    return loss


def _float64_copy(module):
    """A detached float64 copy of a plain ``nn.Module`` (the references' model)."""
    module = copy.deepcopy(module).double()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


# --------------------------------------------------------------------------------------
# Independent references of log p(x) for z ~ N(0, I) and a Bernoulli decoder.
# --------------------------------------------------------------------------------------


def _log_prior(z):
    return (-0.5 * z**2 - 0.5 * math.log(2 * math.pi)).sum(-1)


def laplace_t_reference(log_likelihood, logits, x, start, num_samples, chunk=4000):
    """``log p(x)`` per row of ``x`` by importance sampling from a multivariate Student-t at
    each row's posterior mode, with the inverse Gauss-Newton curvature as scale.

    :param log_likelihood: ``(z (..., N, K), x) -> (..., N)``, the model's ``log p(x | z)``.
    :param logits: ``z (K,) -> (D,)``, the decoder's Bernoulli logits (for the curvature).
    :param torch.Tensor start: ``(N, K)``, where the mode search starts.
    :returns: a :class:`experiments.zoo.deep_models.Reference` (value, SE, k-hat).
    """
    z = start.detach().clone().requires_grad_(True)
    optimizer = torch.optim.LBFGS(
        [z], max_iter=300, line_search_fn="strong_wolfe", tolerance_grad=1e-10
    )

    def closure():
        optimizer.zero_grad()
        loss = -(_log_prior(z) + log_likelihood(z, x)).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    mode = z.detach()
    jacobian = torch.func.vmap(torch.func.jacrev(logits))(mode)  # (N, D, K)
    with torch.no_grad():
        p = torch.sigmoid(torch.func.vmap(logits)(mode)).unsqueeze(-1)
        eye = torch.eye(mode.shape[-1], dtype=mode.dtype)
        curvature = jacobian.transpose(-1, -2) @ (p * (1 - p) * jacobian) + eye
        scale_tril = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(curvature)))
        proposal = dist.MultivariateStudentT(
            torch.tensor(REFERENCE_DF, dtype=mode.dtype), mode, REFERENCE_WIDEN * scale_tril
        )

        def draw(n):
            sample = proposal.sample((n,))
            return _log_prior(sample) + log_likelihood(sample, x) - proposal.log_prob(sample)

        sizes = [chunk] * (num_samples // chunk) + [num_samples % chunk] * bool(num_samples % chunk)
        return deep.log_mean_exp(torch.cat([draw(n) for n in sizes]))


def _grid_log_joint(decoder, x, nodes, log_weights):
    """``log w_g + log p(z_g) + log p(x | z_g)``, ``(N, G)``: torch's Bernoulli of the
    probabilities, written as two matrix products (probabilities clamped as torch does)."""
    eps = torch.finfo(nodes.dtype).eps
    probs = decoder(nodes).clamp(eps, 1 - eps)
    ll = x @ probs.log().T + (1 - x) @ torch.log1p(-probs).T
    return ll + (_log_prior(nodes) + log_weights)


def _product_grid(lo, hi, num_points):
    """Nodes ``(G, 2)`` and log trapezoid weights ``(G,)`` of a product rule on a box."""
    nx, wx = trapezoid_log_weights(float(lo[0]), float(hi[0]), num_points)
    ny, wy = trapezoid_log_weights(float(lo[1]), float(hi[1]), num_points)
    nodes = torch.stack(torch.meshgrid(nx, ny, indexing="ij"), -1).reshape(-1, 2)
    return nodes, (wx[:, None] + wy[None, :]).reshape(-1)


@torch.no_grad()
def grid_reference_2d(decoder, x, coarse, fine, check):
    """``log p(x)`` per row of ``x`` for a 2-D latent by the trapezoid rule: a ``coarse``
    grid over ``[-H, H]^2`` finds, per row, the box of nodes within :data:`GRID_DROP` nats of
    the top (padded by two coarse steps); a ``fine`` and a ``check`` grid cover that box.

    :returns: ``(value (N,), largest |fine - check|, whether a box touched the edge)``.
    """
    half = GRID_HALF_WIDTH
    nodes, log_w = _product_grid((-half, -half), (half, half), coarse)
    log_joint = _grid_log_joint(decoder, x, nodes, log_w)
    step = 2 * half / (coarse - 1)
    values, gaps, edge = [], [], False
    for i in range(len(x)):
        inside = nodes[log_joint[i] >= log_joint[i].max() - GRID_DROP]
        lo, hi = inside.amin(0) - 2 * step, inside.amax(0) + 2 * step
        edge = edge or bool((lo < -half).any() or (hi > half).any())
        fine_value, check_value = (
            torch.logsumexp(_grid_log_joint(decoder, x[i : i + 1], *_product_grid(lo, hi, n)), -1)
            for n in (fine, check)
        )
        values.append(fine_value)
        gaps.append(float((fine_value - check_value).abs()))
    return torch.cat(values), max(gaps), edge


# --------------------------------------------------------------------------------------
# One row: auto's choice and its errors.
# --------------------------------------------------------------------------------------


def _fresh(model):
    """A new function calling ``model``: pyro_mpt warns once per model function and argument
    shapes, so each row sees its own warnings whatever ran before."""

    @functools.wraps(model)
    def fresh(*args, **kwargs):
        return model(*args, **kwargs)

    _FRESH.append(fresh)
    return fresh


def _first_line(error):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _refusal(error):
    """What a refusal says, briefly: auto's reason for importance sampling when auto found
    no strategy, else the first clause of the message."""
    lines = [line.strip() for line in str(error).splitlines()]
    reason = next((line for line in lines if line.startswith("importance:")), None)
    text = reason or (lines[0] if lines else "")
    return f"{type(error).__name__}: {text.split(' when ')[0]}"


def _is_accuracy_warning(w):
    """An ImportanceAccuracyWarning, or auto's warning that its quadrature rule is coarse."""
    return issubclass(w.category, ImportanceAccuracyWarning) or "conditionals='auto'" in str(
        w.message
    )


def _calls(fn, num_calls):
    """``num_calls`` values of ``fn()`` stacked, and the accuracy warnings they raised."""
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        values = torch.stack([fn() for _ in range(num_calls)])
    return values, [str(w.message) for w in caught if _is_accuracy_warning(w)]


def _errors(draws, reference):
    """Per observation: mean of the draws - reference, and the SE of that difference."""
    error = draws.mean(0) - reference.value
    spread = draws.var(0) / draws.shape[0] if draws.shape[0] > 1 else torch.zeros_like(error)
    return error, (spread + reference.se**2).sqrt()


def _tolerance(strategy):
    if isinstance(strategy, Exact):
        return EXACT_TOL
    if isinstance(strategy, ImportanceSampling):
        return IMPORTANCE_TOL
    return QUADRATURE_TOL


def _summary(diagnostics_list):
    """The median over calls of each figure of ``ImportanceDiagnostics.summary()``."""
    if not diagnostics_list:
        return {}
    summaries = [d.summary() for d in diagnostics_list]
    figures = {k: statistics.median(s[k] for s in summaries) for k in summaries[0]}
    return dict(figures, num_samples=diagnostics_list[-1].num_samples)


def accuracy_row(name, model, guide, args, reference, num_calls, num_log_marginal_calls):
    """Auto's choice for ``model``, the error of ``num_calls`` uniform-rate MPT estimates
    with ``num_masks=D`` and of ``num_log_marginal_calls`` ``log_marginal`` calls against
    ``reference`` (None: no reference), and the warnings raised.

    :returns: a JSON-able dict.
    """
    model = _fresh(model)
    num_features = args[0].shape[-1]
    loss = MPTLoss(rate="uniform", num_masks=num_features, conditionals="auto")
    diagnostics = []

    def estimate():
        value = loss.estimate(model, guide, *args)
        if loss.diagnostics is not None:
            diagnostics.append(loss.diagnostics)
        return value

    row = dict(model=name, num_observations=int(args[0].shape[-2]), num_features=num_features)
    start = time.perf_counter()
    try:
        draws, messages = _calls(estimate, num_calls)
    except Exception as error:  # noqa: BLE001 - a refusal is a row of the table
        refused = isinstance(error, ValueError)
        return dict(
            row,
            chosen="refused" if refused else "error",
            outcome=_refusal(error),
            message=str(error),
            warned=False,
            verdict="refused" if refused else "ERROR",
            seconds=time.perf_counter() - start,
        )
    chosen = loss.conditionals.chosen
    row.update(
        chosen=repr(chosen),
        reason=loss.conditionals.reason,
        num_calls=num_calls,
        warned=bool(messages),
        warnings=messages[:2],
        figures=_summary(diagnostics),
    )
    lm_strategy = as_conditionals("auto")
    lm_draws, lm_messages = _calls(
        lambda: log_marginal(model, *args, guide=guide, conditionals=lm_strategy),
        num_log_marginal_calls,
    )
    # log_marginal's own check of its (full-data) weights, apart from auto's search, which
    # probes the weights of masked conditionals.
    own = [m for m in lm_messages if m.startswith("log_marginal")]
    row.update(
        log_marginal_chosen=repr(lm_strategy.chosen),
        log_marginal_warned=bool(own),
        log_marginal_search_warned=len(own) < len(lm_messages),
        log_marginal_warnings=lm_messages[:2],
        seconds=time.perf_counter() - start,
    )
    if reference is None:
        row.update(verdict="scored (no reference)", finite=bool(draws.isfinite().all()))
        return row
    error, se = _errors(draws, reference)
    worst = int((error.abs() - 4 * se).argmax())
    n = error.numel()
    right = bool((error.abs() <= 4 * se + _tolerance(chosen)).all())
    row.update(
        mpt_error=float(error.mean()),
        mpt_se=float(se.pow(2).sum().sqrt() / n),
        mpt_worst=float(error[worst]),
        mpt_worst_se=float(se[worst]),
        mpt_errors=error.tolist(),
        verdict="right" if right else ("flagged" if messages else "SILENTLY OFF"),
        reference_se_max=float(reference.se.max()),
        reference_khat_max=None if reference.khat is None else float(reference.khat.max()),
    )
    lm_error, lm_se = _errors(lm_draws, reference)
    row.update(
        log_marginal_error=float(lm_error.mean()),
        log_marginal_se=float(lm_se.pow(2).sum().sqrt() / n),
        log_marginal_worst=float(lm_error[int(lm_error.abs().argmax())]),
    )
    return row


# --------------------------------------------------------------------------------------
# The sections.
# --------------------------------------------------------------------------------------


def _example_vae_z50(sizes, seed, steps):
    """Pyro's example VAE, z=50: accuracy row and the SVI step timing (float32 model)."""
    x, _ = load_mnist(num_samples=sizes["num_images"], seed=seed, dtype=torch.float32)
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    vae = ExampleVAE()
    elbo = _train_elbo(vae.model, vae.guide, x, sizes, seed)
    scored = x[: sizes["num_scored"]]
    vae64 = _float64_copy(vae)
    scored64 = scored.double()
    with set_default_dtype(torch.float64), torch.no_grad():
        loc, scale = vae64.encoder(scored64)
        draws = loc + scale * torch.randn((200,) + loc.shape, dtype=torch.float64)
        gap = (
            vae.log_likelihood(draws.float(), scored).double()
            - vae64.log_likelihood(draws, scored64)
        ).abs()
    with set_default_dtype(torch.float64):
        reference = laplace_t_reference(
            vae64.log_likelihood, vae64.decoder.logits, scored64, loc, sizes["reference_samples"]
        )
    row = accuracy_row(
        f"pyro-vae z={PYRO_VAE_LATENT} (MNIST, float32)",
        vae.model,
        vae.guide,
        (scored,),
        reference,
        sizes["num_calls"],
        sizes["num_log_marginal_calls"],
    )
    row.update(
        section="Pyro's VAE example",
        reference_name=f"Laplace-t importance, S={sizes['reference_samples']}, float64",
        train_elbo_per_image=-elbo,
        dtype_gap=float(gap.max()),
    )
    # The example's own encoder flattens its input to (-1, 784): refused, not misread.
    flat = ExampleVAE(flatten=True)
    flat.load_state_dict(vae.state_dict())
    flat_row = accuracy_row(
        f"pyro-vae z={PYRO_VAE_LATENT}, encoder flattens x.reshape(-1, 784)",
        flat.model,
        flat.guide,
        (scored,),
        None,
        1,
        1,
    )
    flat_row.update(section="Pyro's VAE example", reference_name="none: must be refused")
    # One SVI step of MPTLoss() (auto) against one of Trace_ELBO, interleaved.
    batch = x[: sizes["batch_size"]]
    losses = {"elbo": Trace_ELBO(), "mpt": MPTLoss()}
    svis = {
        name: SVI(vae.model, vae.guide, pyro.optim.Adam({"lr": LEARNING_RATE}), loss=loss)
        for name, loss in losses.items()
    }
    fns = {name: (lambda s=s: s.step(batch)) for name, s in svis.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ImportanceAccuracyWarning)
        times = time_calls(fns, "cpu", steps, sizes["repeats"], warmup=2)
    ms = {name: statistics.median(t) for name, t in times.items()}
    timing = dict(
        model=f"pyro-vae z={PYRO_VAE_LATENT}, batch {len(batch)}, float32",
        chosen=repr(losses["mpt"].conditionals.chosen),
        elbo_ms=ms["elbo"],
        mpt_ms=ms["mpt"],
        ratio=ms["mpt"] / ms["elbo"],
        times=times,
    )
    return [row, flat_row], timing


def _example_vae_z2(sizes, seed):
    """Pyro's example VAE with z=2, float64, against a dense grid."""
    with set_default_dtype(torch.float64):
        x, _ = load_mnist(num_samples=sizes["num_images"], seed=seed)
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        vae = ExampleVAE(z_dim=2)
        elbo = _train_elbo(vae.model, vae.guide, x, sizes, seed)
        scored = x[: sizes["num_scored_z2"]]
        value, gap, edge = grid_reference_2d(
            vae.decoder, scored, sizes["grid_coarse"], sizes["grid_fine"], sizes["grid_check"]
        )
        reference = deep.Reference(value, torch.zeros_like(value))
        row = accuracy_row(
            "pyro-vae z=2 (MNIST, float64)",
            vae.model,
            vae.guide,
            (scored,),
            reference,
            sizes["num_calls_z2"],
            sizes["num_log_marginal_calls"],
        )
    row.update(
        section="Pyro's VAE example",
        reference_name=f"2-D trapezoid grid {sizes['grid_fine']}^2 per image",
        grid_check_gap=gap,
        grid_touches_edge=edge,
        train_elbo_per_image=-elbo,
    )
    return row


DEEP_CASES = {
    "bernoulli_vae": deep.bernoulli_vae,
    "semi_supervised_vae": deep.semi_supervised_vae,
    "sparse_gamma_def": deep.sparse_gamma_def,
    "gaussian_mixture_d1": functools.partial(deep.gaussian_mixture, 1),
    "gaussian_mixture_d4": functools.partial(deep.gaussian_mixture, 4),
    "eight_schools_normal": functools.partial(deep.eight_schools, "normal"),
    "eight_schools_t": functools.partial(deep.eight_schools, "t"),
    "prodlda_softmax_dim1": functools.partial(deep.prodlda, 1),
    "prodlda_softmax_dim-1": functools.partial(deep.prodlda, -1),
}


def _deep_rows(sizes, seed):
    """The models of experiments/zoo/deep_models.py, with their references, float64."""
    rows = []
    with set_default_dtype(torch.float64):
        for name in sizes["deep_cases"]:
            case = DEEP_CASES[name]()
            case.restore()
            pyro.set_rng_seed(seed)
            draws = sizes["deep_draws"] or DEEP_DRAWS.get(name, DEEP_DEFAULT_DRAWS)
            row = accuracy_row(
                name,
                case.model,
                case.guide,
                case.args,
                case.reference,
                draws,
                sizes["num_log_marginal_calls"],
            )
            row.update(
                section="experiments/zoo/deep_models.py", reference_name=DEEP_REFERENCES[name]
            )
            rows.append(row)
    return rows


#: How experiments/zoo/deep_models.py computes each reference.
DEEP_REFERENCES = {
    "bernoulli_vae": "importance, widened encoder (tests)",
    "semi_supervised_vae": "sum over y of importance (tests)",
    "sparse_gamma_def": "defensive importance (tests)",
    "gaussian_mixture_d1": "enumeration (tests)",
    "gaussian_mixture_d4": "enumeration (tests)",
    "eight_schools_normal": "closed form (tests)",
    "eight_schools_t": "1-D grid (tests)",
    "prodlda_softmax_dim1": "none: must be refused",
    "prodlda_softmax_dim-1": "none: must be scored",
}


def _trained_by_mpt(sizes, seed):
    """A deep VAE trained by MPTLoss(conditionals='auto') and by Trace_ELBO from the same
    start and batches: objective per image at the end against log p(x)."""
    total = sizes["deep_train"] + sizes["deep_held_out"]
    x, _ = load_mnist(num_samples=total, seed=seed + 1, dtype=torch.float32)
    train, held_out = x[: sizes["deep_train"]], x[sizes["deep_train"] :]
    evaluated = train[: sizes["deep_eval_images"]]
    rows = []
    for name in ("MPTLoss(conditionals='auto')", "Trace_ELBO"):
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        vae = VAE(num_features=784, latent_dim=DEEP_LATENT, hidden_dim=DEEP_HIDDEN)
        loss = MPTLoss(conditionals="auto") if name.startswith("MPT") else Trace_ELBO()
        svi = SVI(vae.model, vae.guide, pyro.optim.Adam({"lr": DEEP_LR}), loss=loss)
        generator = torch.Generator().manual_seed(seed)
        losses, figures, first_warning = [], [], None
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(sizes["deep_steps"]):
                idx = torch.randint(len(train), (sizes["batch_size"],), generator=generator)
                losses.append(svi.step(train[idx]) / len(idx))
                if getattr(loss, "diagnostics", None) is not None:
                    figures.append(loss.diagnostics)
                if first_warning is None and any(_is_accuracy_warning(w) for w in caught):
                    first_warning = step
        seconds = time.perf_counter() - start
        messages = [str(w.message) for w in caught if _is_accuracy_warning(w)]
        chosen = getattr(loss, "conditionals", None)
        chosen = None if chosen is None else chosen.chosen
        objective = _final_objective(vae, evaluated, chosen, sizes["deep_eval_calls"])
        decoder = _plain_float64(vae.decoder)
        lml = {
            part: _vae_reference(vae, decoder, images, sizes["deep_reference_samples"])
            for part, images in (("train", evaluated), ("held_out", held_out))
        }
        last = max(1, len(losses) // 10)
        rows.append(
            dict(
                loss=name,
                chosen="–" if chosen is None else repr(chosen),
                seconds=seconds,
                last_steps_objective=-statistics.mean(losses[-last:]),
                objective=float(objective.mean()),
                objective_se=float(objective.std() / math.sqrt(len(objective))),
                lml_train=float(lml["train"].value.mean()),
                lml_train_se=float(lml["train"].se.pow(2).sum().sqrt() / len(evaluated)),
                lml_held_out=float(lml["held_out"].value.mean()),
                lml_held_out_se=float(lml["held_out"].se.pow(2).sum().sqrt() / len(held_out)),
                reference_khat_max=float(
                    torch.cat([lml["train"].khat, lml["held_out"].khat]).max()
                ),
                gap=float(objective.mean() - lml["train"].value.mean()),
                warned=bool(messages),
                first_warning_step=first_warning,
                warnings=messages[:2],
                figures=_summary(figures[-last:]),
                failing_last_steps=(
                    statistics.mean(not d.reliable() for d in figures[-last:]) if figures else None
                ),
            )
        )
    return rows


@torch.no_grad()
def _final_objective(vae, x, chosen, num_calls):
    """The training objective per image at the final parameters on ``x``, once per call:
    the MPT estimate (uniform rate, one mask per image, the chosen conditionals) or the
    one-particle ELBO."""
    loss = Trace_ELBO() if chosen is None else MPTLoss(rate="uniform", conditionals=chosen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ImportanceAccuracyWarning)
        values = [-loss.loss(vae.model, vae.guide, x) / len(x) for _ in range(num_calls)]
    return torch.tensor(values)


def _plain_float64(sequential):
    """A float64 ``nn.Sequential`` with the weights of a (Pyro) MLP of Linear layers and
    activations, detached from Pyro's param store."""
    layers = []
    for layer in sequential:
        if isinstance(layer, nn.Linear):
            plain = nn.Linear(layer.in_features, layer.out_features, dtype=torch.float64)
            plain.load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()})
            layers.append(plain.requires_grad_(False))
        else:
            layers.append(copy.deepcopy(layer))
    return nn.Sequential(*layers)


def _vae_reference(vae, decoder, images, num_samples):
    """The Laplace-t reference of log p(x) for :class:`pyro_mpt.models.VAE` (Bernoulli)."""
    images = images.double()
    with torch.no_grad():
        start = vae.encode(images.float())[0].double()

    def log_likelihood(z, x):
        return -F.binary_cross_entropy_with_logits(
            decoder(z), x.expand(z.shape[:-1] + x.shape[-1:]), reduction="none"
        ).sum(-1)

    with set_default_dtype(torch.float64):
        return laplace_t_reference(log_likelihood, decoder, images, start, num_samples)


def _log_marginal_store(seed):
    """``log_marginal`` with a guide whose parameters are sized by the data, then a
    Trace_ELBO step on data of another size."""
    rows = []
    generator = torch.Generator().manual_seed(seed)
    with set_default_dtype(torch.float64):
        x = torch.bernoulli(torch.full((10, 6), 0.4), generator=generator)
        other = torch.bernoulli(torch.full((7, 6), 0.4), generator=generator)

        def model(x):
            w = pyro.param("w", lambda: torch.linspace(-1.5, 1.5, x.shape[-1]))
            with pyro.plate("data", x.shape[-2]):
                z = pyro.sample("z", dist.Normal(0.0, 1.0))
                pyro.sample("x", dist.Bernoulli(logits=z.unsqueeze(-1) * w).to_event(1), obs=x)

        for sized_by, size in (("len(x)", len), ("x.shape[-2]", lambda x: x.shape[-2])):

            def guide(x, size=size):
                loc = pyro.param("q_loc", lambda: torch.zeros(size(x)))
                scale = pyro.param(
                    "q_scale", lambda: torch.ones(size(x)), constraint=dist.constraints.positive
                )
                with pyro.plate("data", x.shape[-2]):
                    pyro.sample("z", dist.Normal(loc, scale))

            for label, conditionals in (
                ("default ('exact')", None),
                ("'auto'", "auto"),
                ("ImportanceSampling(64)", ImportanceSampling(64)),
            ):
                pyro.clear_param_store()
                pyro.set_rng_seed(seed)
                model(x)  # the model's own parameter exists before the call
                store = pyro.get_param_store()
                before = dict(store.named_parameters())
                kwargs = {} if conditionals is None else {"conditionals": conditionals}
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", ImportanceAccuracyWarning)
                        value = log_marginal(model, x, guide=guide, **kwargs)
                    finite = bool(value.isfinite().all())
                    outcome = f"returned {tuple(value.shape)}, finite={finite}"
                except Exception as error:  # noqa: BLE001 - an error is a row of the table
                    outcome = _first_line(error)[:90]
                after = dict(store.named_parameters())
                kept = list(after) == list(before) and all(after[k] is v for k, v in before.items())
                svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
                try:
                    step = svi.step(other)
                    shape = tuple(store.get_param("q_loc").shape)
                    elbo_outcome = f"ok (loss {step:.2f}); q_loc {shape}"
                except Exception as error:  # noqa: BLE001
                    elbo_outcome = _first_line(error)[:90]
                rows.append(
                    dict(
                        sized_by=sized_by,
                        conditionals=label,
                        outcome=outcome,
                        store_after=", ".join(after) or "(empty)",
                        store_kept=kept,
                        elbo_step=elbo_outcome,
                    )
                )
    return rows


def run(device="cpu", steps=1, repeats=7, smoke=False, seed=0):
    """Measures every section (on the CPU).

    :returns: ``{"config", "environment", "results", "svi_step", "trained_by_mpt",
        "log_marginal_store"}``; ``results`` are the accuracy rows.
    """
    if torch.device(device).type != "cpu":
        raise SystemExit(f"--device {device}: this table runs on the CPU only; use --device cpu.")
    sizes = dict(
        num_images=NUM_IMAGES,
        batch_size=BATCH_SIZE,
        repeats=repeats,
        train_steps=TRAIN_STEPS,
        num_scored=NUM_SCORED,
        num_calls=NUM_CALLS,
        num_log_marginal_calls=NUM_LOG_MARGINAL_CALLS,
        num_scored_z2=NUM_SCORED_Z2,
        num_calls_z2=NUM_CALLS_Z2,
        reference_samples=REFERENCE_SAMPLES,
        grid_coarse=GRID_COARSE,
        grid_fine=GRID_FINE,
        grid_check=GRID_CHECK,
        deep_draws=None,
        deep_cases=tuple(DEEP_CASES),
        deep_train=DEEP_TRAIN,
        deep_held_out=DEEP_HELD_OUT,
        deep_steps=DEEP_STEPS,
        deep_eval_images=DEEP_EVAL_IMAGES,
        deep_eval_calls=DEEP_EVAL_CALLS,
        deep_reference_samples=DEEP_REFERENCE_SAMPLES,
    )
    if smoke:
        sizes.update(SMOKE)
    pyro.enable_validation(True)
    logging.getLogger("pyro").setLevel(logging.WARNING)  # Pyro's max_plate_nesting guesses
    start = time.perf_counter()
    seconds = {}
    results, timing = _example_vae_z50(sizes, seed, steps)
    seconds["pyro-vae z=50"] = time.perf_counter() - start
    results.append(_example_vae_z2(sizes, seed))
    seconds["pyro-vae z=2"] = time.perf_counter() - start - sum(seconds.values())
    results += _deep_rows(sizes, seed)
    seconds["deep models"] = time.perf_counter() - start - sum(seconds.values())
    trained = _trained_by_mpt(sizes, seed)
    seconds["trained by MPT"] = time.perf_counter() - start - sum(seconds.values())
    store = _log_marginal_store(seed)
    seconds["log_marginal store"] = time.perf_counter() - start - sum(seconds.values())
    names = (
        "PYRO_VAE_HIDDEN",
        "PYRO_VAE_LATENT",
        "LEARNING_RATE",
        "REFERENCE_DF",
        "REFERENCE_WIDEN",
        "GRID_HALF_WIDTH",
        "GRID_DROP",
        "EXACT_TOL",
        "QUADRATURE_TOL",
        "IMPORTANCE_TOL",
        "DEEP_LATENT",
        "DEEP_HIDDEN",
        "DEEP_LR",
    )
    config = {**constants(globals(), *names), **sizes}
    report = make_report(device, results, config, steps=steps, smoke=smoke)
    report.update(svi_step=[timing], trained_by_mpt=trained, log_marginal_store=store)
    report["seconds"] = dict(seconds, total=time.perf_counter() - start)
    return report


def _error_cell(row, key):
    if f"{key}_error" not in row:
        return "–"
    cell = f"{row[f'{key}_error']:+.3f} ± {row[f'{key}_se']:.3f} (worst {row[f'{key}_worst']:+.2f})"
    if key == "log_marginal" and row["log_marginal_warned"]:
        cell += ", warned"
    elif key == "log_marginal" and row["log_marginal_search_warned"]:
        cell += ", auto's probe warned"
    return cell


def _warning_cell(row):
    if row["chosen"] in ("refused", "error"):
        return row["outcome"][:110]
    figures = row.get("figures") or {}
    if not figures:  # exact or quadrature: no weights to judge
        return f"warned: {row['warnings'][0][:60]}" if row["warned"] else "none (no sampling)"
    text = "warned" if row["warned"] else "silent"
    median_k = "n/a" if math.isnan(figures["median_k"]) else f"{figures['median_k']:.2f}"
    return text + (
        f": k-hat>0.7 in {100 * figures['unreliable']:.0f}%, median k-hat {median_k}, "
        f"ESS {figures['median_ess']:.1f}/{figures['num_samples']}"
    )


def _training_warning_cell(row):
    if row["chosen"] == "–":
        return "–"
    when = "none" if row["first_warning_step"] is None else f"at step {row['first_warning_step']}"
    figures = _warning_cell(dict(row, chosen="", warned=False)).replace("silent: ", "")
    return f"{when}; {figures}; failing {100 * row['failing_last_steps']:.0f}% of steps"


def print_report(report):
    """Prints the accuracy table, the SVI step timing, the trained-by-MPT comparison and the
    param-store check."""
    print_results(
        report,
        "model: {model} | auto chose: {chosen} | MPT error/obs ± SE (worst): {mpt} | "
        "log_marginal error ± SE: {lm} | warning (k-hat, ESS) or refusal: {warning} | "
        "verdict: {verdict} | reference: {reference_name}",
        "Uniform-rate MPT estimate (num_masks=D) and log_marginal under conditionals='auto' "
        "against an independent log p(x): mean error per observation in nats, its SE (draws "
        "and reference), the observation furthest beyond 4 SE ({threads} thread(s), torch "
        "{torch}, pyro {pyro})",
        mpt=lambda r: _error_cell(r, "mpt"),
        lm=lambda r: _error_cell(r, "log_marginal"),
        warning=_warning_cell,
    )
    z50, z2 = (
        next(r for r in report["results"] if key in r) for key in ("dtype_gap", "grid_check_gap")
    )
    print(
        f"z=50: float32 vs float64 log p(x|z) gap {z50['dtype_gap']:.1e} nats; reference "
        f"k-hat max {z50['reference_khat_max']:.2f}, SE max {z50['reference_se_max']:.3f}. "
        f"z=2: fine vs check grid {z2['grid_check_gap']:.1e} nats, box at the edge: "
        f"{z2['grid_touches_edge']}."
    )
    print()
    print_results(
        {**report, "results": report["svi_step"]},
        "model: {model} | auto chose: {chosen} | Trace_ELBO ms: {elbo_ms:.1f} | "
        "MPTLoss() ms: {mpt_ms:.1f} | MPT / ELBO: {ratio:.1f}x",
        "One SVI step, median of {repeats} ({threads} thread(s))",
    )
    print()
    print_results(
        {**report, "results": report["trained_by_mpt"]},
        "loss: {loss} | auto chose: {chosen} | objective/img, last steps: "
        "{last_steps_objective:.2f} | objective/img, final: {objective:.2f} ± {objective_se:.2f} | "
        "log p(x), same images: {lml_train:.2f} ± {lml_train_se:.3f} | objective - log p(x): "
        "{gap:+.2f} | held-out log p(x): {lml_held_out:.2f} ± {lml_held_out_se:.3f} | "
        "warning; last steps: {warning} | s: {seconds:.0f}",
        "Deep VAE (K={deep_latent}, {deep_hidden} hidden) trained {deep_steps} steps on "
        "{deep_train} digits; objective on {deep_eval_images} training images; log p(x) by "
        "Laplace-t importance (float64)",
        warning=_training_warning_cell,
    )
    print()
    print_results(
        {**report, "results": report["log_marginal_store"]},
        "guide sized by: {sized_by} | conditionals: {conditionals} | log_marginal: {outcome} | "
        "store after: {store_after} | store kept: {store_kept} | Trace_ELBO step, N=7: "
        "{elbo_step}",
        "log_marginal(model, x (N=10), guide=g): Pyro's param store afterwards (it held 'w')",
    )
    seconds = ", ".join(f"{k} {v:.0f} s" for k, v in report["seconds"].items())
    print(f"\nTime: {seconds}.")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not any(arg == "--json" or arg.startswith("--json=") for arg in argv):
        DEFAULT_JSON.parent.mkdir(exist_ok=True)
        argv += ["--json", str(DEFAULT_JSON)]
    if not any(arg == "--threads" or arg.startswith("--threads=") for arg in argv):
        argv += ["--threads", "1"]
    smoke = ("--smoke", {"action": "store_true", "help": "a few seconds: tiny sizes"})
    seed = ("--seed", {"type": int, "default": 0, "help": "seed of data, models and draws"})
    return benchmark_main(
        __doc__, argv, run, print_report, steps=1, repeats=7, options=[smoke, seed]
    )


if __name__ == "__main__":
    main()
