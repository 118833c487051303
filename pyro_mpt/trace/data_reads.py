"""Whether a model's distributions read the data they observe.

Every strategy takes ``p(x_j | x_R)`` from a likelihood whose features are independent
given the latents. A model whose likelihood (or a latent's prior) is computed from the
observed data itself, such as an autoregressive term ``loc = a * x[..., :-1]``, breaks that
silently: a masked entry's own value stays in the distributions of the others, as a known
covariate. ``log p(x)`` of the whole data is still right, and so is anything whose value
is a chain-rule total of it (``MPTLoss(rate="uniform")``, ``log_marginal``), but the
conditionals of masked inputs, and the draws, curves and fixed-rate objectives made of
them, are not. :func:`check_data_not_read` finds such a model by running it again on the
data shuffled, with every latent replayed, and comparing the densities of the first run's
values.
"""

import pyro
import pyro.poutine as poutine
import torch
from pyro.distributions import Independent, MaskedDistribution

from pyro_mpt.trace.model_structure import latent_names_in, observed_names_in
from pyro_mpt.trace.trace_utils import RandomState, same_random_state
from pyro_mpt.trace.vectorized_run_check import CheckedCalls

__all__ = ["check_data_not_read", "data_read_by"]

#: The (model, argument shapes) calls that passed :func:`check_data_not_read`: it runs the
#: model three times, so once per such call.
_PASSED = CheckedCalls()

#: How far (relative) a density may move between the two runs by rounding alone.
_TOLERANCE = 1e-5


def _shuffled(value):
    """``value`` with its features rotated by one, and its observations too: the same
    values (valid for any likelihood the data were valid for) at other places."""
    shuffled = value.roll(1, -1)
    if value.dim() > 1:
        shuffled = shuffled.roll(1, 0)
    return shuffled


def _data_arguments(args, kwargs, observed_values):
    """The positions (ints) and keywords (strs) of the tensor arguments that a model
    observes as they are: the same tensor, or equal values of the same shape."""
    found = []
    for key, value in [*enumerate(args), *kwargs.items()]:
        if not torch.is_tensor(value):
            continue
        for seen in observed_values:
            if value is seen or (
                value.shape == seen.shape and value.dtype == seen.dtype and torch.equal(value, seen)
            ):
                found.append(key)
                break
    return found


def _unmasked(fn):
    """``fn`` without its masks (``.mask(...)``): a mask computed from the data (which
    entries are missing) moves with the data, but it is no density."""
    if isinstance(fn, MaskedDistribution):
        return _unmasked(fn.base_dist)
    if isinstance(fn, Independent):
        return Independent(_unmasked(fn.base_dist), fn.reinterpreted_batch_ndims)
    return fn


def _argument(args, kwargs, key):
    return args[key] if isinstance(key, int) else kwargs[key]


def _log_density(site, value):
    """The log-density at ``value`` of the site's distribution, its masks left out, or None
    where it cannot be evaluated."""
    try:
        return _unmasked(site["fn"]).log_prob(value).detach()
    except (ValueError, RuntimeError, NotImplementedError):
        return None


def data_read_by(model, args, kwargs):
    """The name of the first observed or latent site of ``model`` whose distribution moves
    when the data argument it observes is shuffled (every latent at the same value), and
    the argument (a position or a keyword): ``(site, argument)``, or ``None`` when none
    moves or no argument is observed as it is (nothing to shuffle). Three runs of the model:
    one draws the latents, two replay them from the same random state; torch's random state
    is then left as it was found."""
    with same_random_state(), torch.no_grad(), pyro.validation_enabled(False):
        drawn = poutine.trace(model).get_trace(*args, **kwargs)
        observed = observed_names_in(drawn)
        values = [drawn.nodes[name]["value"] for name in observed]
        keys = _data_arguments(args, kwargs, values)
        shuffled_args, shuffled_kwargs = list(args), dict(kwargs)
        for key in keys:
            target = shuffled_args if isinstance(key, int) else shuffled_kwargs
            target[key] = _shuffled(target[key])
        if all(
            torch.equal(
                _argument(shuffled_args, shuffled_kwargs, key), _argument(args, kwargs, key)
            )
            for key in keys
        ):
            return None  # constant data, or none observed as given: nothing to shuffle
        # Both runs replay the latents drawn above, from one random state: draws made inside
        # the model (dropout) repeat, so only the data differ between them.
        replayed = poutine.replay(model, trace=drawn)
        start = RandomState()
        trace = poutine.trace(replayed).get_trace(*args, **kwargs)
        start.restore()
        try:
            again = poutine.trace(replayed).get_trace(*shuffled_args, **shuffled_kwargs)
        except Exception:  # the model cannot run on shuffled data: nothing to tell
            return None
    for name in [*latent_names_in(trace), *observed]:
        site = trace.nodes[name]
        if name not in again.nodes:
            continue
        before = _log_density(site, site["value"])
        after = _log_density(again.nodes[name], site["value"])
        if before is None or after is None or before.shape != after.shape:
            continue
        finite = torch.isfinite(before) & torch.isfinite(after)
        moved = (before - after).abs() > _TOLERANCE * (1 + before.abs())
        appeared = torch.isfinite(before) != torch.isfinite(after)
        if bool((moved & finite).any()) or bool(appeared.any()):
            return name, keys[0]
    return None


def check_data_not_read(model, args, kwargs, what):
    """Raises ``ValueError`` when a distribution of ``model`` reads the data it observes
    (:func:`data_read_by`): ``what`` (the caller, in words) would score or draw from
    conditionals that take the masked entries' own values as known. Once per model and
    argument shapes."""
    if _PASSED.seen(model, None, args, kwargs, None):
        return
    found = data_read_by(model, args, kwargs)
    if found is None:
        return
    _PASSED.forget(model, None, args, kwargs, None)
    site, key = found
    argument = f"positional argument {key}" if isinstance(key, int) else f"keyword argument {key!r}"
    raise ValueError(
        f"{what} needs the conditionals p(x_j | x_R) of masked inputs, but the distribution "
        f"of site {site!r} changes when the data the model observes (its {argument}) "
        f"change, every latent held fixed: it is computed from the data itself (e.g. an "
        f"autoregressive term such as a * x[..., :-1]). Its conditionals would take each "
        f"masked entry's own value as known, and come out wrong. Write the dependence "
        f"between features through latents, so that no distribution reads the observed "
        f"values. log_marginal and MPTLoss(rate='uniform') stay exact for such a model: "
        f"their totals do not depend on how p(x) splits into conditionals."
    )
