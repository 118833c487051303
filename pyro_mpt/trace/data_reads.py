"""Whether a model's distributions read the data they observe.

Every strategy takes ``p(x_j | x_R)`` from a likelihood whose features are independent
given the latents. A model whose likelihood (or a latent's prior, or a ``pyro.factor``) is
computed from the observed data itself, such as an autoregressive term
``loc = a * x[..., :-1]``, a centring by the batch mean or a penalty on neighbouring
features, breaks that silently: a masked entry's own value stays in the distributions of
the others, as a known covariate. ``log p(x)`` of the whole data is still right, and so is
anything whose value is a chain-rule total of it (``MPTLoss(rate="uniform")``,
``log_marginal``), but the conditionals of masked inputs, and the draws, curves and
fixed-rate objectives made of them, are not.

:func:`check_data_not_read` finds such a model in two ways, each with every latent at the
value of one run:

* **by gradients**, for each floating tensor argument (inside a dict, list or tuple too):
  the argument is data when the observed values depend on it, through any computation
  (``obs=x / 10``, ``obs=x.T``, ``obs=x.nan_to_num()``, a subsample); a distribution then
  reads it when its density at the run's values has a gradient path to it. Structural,
  so a read whose effect happens to cancel on these data (a permutation-invariant
  statistic, constant data) is found too;
* **by values**, for the arguments observed as they are (integer data, and models that cut
  the gradient with ``detach`` or ``torch.no_grad``): the model runs again with one entry of
  the data replaced by another of its values, and the densities of the first run's values
  are compared.

Data the model takes from elsewhere (a closure, an attribute) or a lagged copy of the data
passed as an argument of its own cannot be told from a covariate and are not checked.
"""

import pyro
import pyro.poutine as poutine
import torch
from pyro.distributions import Independent, MaskedDistribution

from pyro_mpt.trace.model_structure import latent_names_in, observed_names_in
from pyro_mpt.trace.trace_utils import RandomState, same_random_state
from pyro_mpt.trace.vectorized_run_check import CheckedCalls

__all__ = ["check_data_not_read", "data_read_by"]

#: The (model, argument shapes) calls that passed :func:`check_data_not_read` after a real
#: comparison (some argument was found to be the data): it runs the model several times,
#: so once per such call.
_PASSED = CheckedCalls()

#: How far (relative) a density may move between two runs by rounding alone.
_TOLERANCE = 1e-5


def _tensor_places(args, kwargs):
    """Where the tensor arguments are: ``(key, path)`` pairs, ``key`` a position (int) or a
    keyword (str) and ``path`` the keys or indices inside dicts, lists and tuples."""
    places = []

    def visit(value, key, path):
        if torch.is_tensor(value):
            places.append((key, path))
        elif isinstance(value, dict):
            for inner, item in value.items():
                visit(item, key, path + (inner,))
        elif isinstance(value, (list, tuple)):
            for inner, item in enumerate(value):
                visit(item, key, path + (inner,))

    for key, value in [*enumerate(args), *kwargs.items()]:
        visit(value, key, ())
    return places


def _at(args, kwargs, place):
    key, path = place
    value = args[key] if isinstance(key, int) else kwargs[key]
    for inner in path:
        value = value[inner]
    return value


def _replaced(args, kwargs, place, new):
    """Copies of ``args`` and ``kwargs`` with the tensor at ``place`` replaced by ``new``;
    the containers on the way are copied, the user's are left as they are."""

    def put(value, path):
        if not path:
            return new
        inner, rest = path[0], path[1:]
        if isinstance(value, dict):
            return {**value, inner: put(value[inner], rest)}
        items = list(value)
        items[inner] = put(items[inner], rest)
        if isinstance(value, list):
            return items
        return type(value)._make(items) if hasattr(value, "_make") else type(value)(items)

    key, path = place
    args, kwargs = list(args), dict(kwargs)
    if isinstance(key, int):
        args[key] = put(args[key], path)
    else:
        kwargs[key] = put(kwargs[key], path)
    return args, kwargs


def _unmasked(fn):
    """``fn`` without its masks (``.mask(...)``): a mask computed from the data (which
    entries are missing) moves with the data, but it is no density."""
    if isinstance(fn, MaskedDistribution):
        return _unmasked(fn.base_dist)
    if isinstance(fn, Independent):
        return Independent(_unmasked(fn.base_dist), fn.reinterpreted_batch_ndims)
    return fn


def _log_density(site, value):
    """The log-density at ``value`` of the site's distribution, its masks left out, or None
    where it cannot be evaluated."""
    try:
        return _unmasked(site["fn"]).log_prob(value)
    except (ValueError, RuntimeError, NotImplementedError):
        return None


def _compared_sites(trace):
    """The latent, observed and ``pyro.factor`` sites of a run, latents first."""
    factors = [
        name
        for name, site in trace.nodes.items()
        if site["type"] == "sample" and isinstance(site["fn"], pyro.distributions.Unit)
    ]
    return [*latent_names_in(trace), *observed_names_in(trace), *factors]


def _depends_on(tensor, leaf):
    """Whether ``tensor`` is computed from ``leaf`` (a path in the autograd graph)."""
    if not (torch.is_tensor(tensor) and tensor.requires_grad):
        return False
    try:
        grad = torch.autograd.grad(tensor.sum(), leaf, allow_unused=True, retain_graph=True)
    except RuntimeError:  # an operation with no derivative on the way: not a known path
        return False
    return grad[0] is not None


def _read_by_gradients(replayed, args, kwargs, place):
    """``(site, is_data)``: the first site whose density at the run's values has a gradient
    path to the floating tensor at ``place`` (else None), and whether the observed values
    have one (True), have none (False: a covariate), or the model could not run with a
    tensor that requires grad (None: no verdict)."""
    leaf = _at(args, kwargs, place).detach().clone().requires_grad_()
    try:
        with torch.enable_grad():  # the callers may run under torch.no_grad
            # A copy that is no leaf: a model that writes into its data in place can.
            traced_args, traced_kwargs = _replaced(args, kwargs, place, leaf.clone())
            trace = poutine.trace(replayed).get_trace(*traced_args, **traced_kwargs)
            observed = [trace.nodes[name]["value"] for name in observed_names_in(trace)]
            if not any(_depends_on(value, leaf) for value in observed):
                return None, False
            for name in _compared_sites(trace):
                site = trace.nodes[name]
                value = site["value"].detach() if torch.is_tensor(site["value"]) else None
                if _depends_on(_log_density(site, value), leaf):
                    return name, True
    except Exception:
        return None, None
    return None, True


def _perturbed(value):
    """``value`` with its first observation replaced by the first one that differs from it
    (or, for one observation, its first entry by the first other value): values the data
    hold, so valid for any likelihood the data were valid for, and not a permutation, so a
    statistic of the whole data (a mean, a sum) moves too. None for constant data."""
    rows = value.reshape(value.shape[0], -1) if value.dim() > 1 else value.reshape(1, -1)
    if value.dim() > 1 and value.shape[0] > 1:
        differ = (rows != rows[:1]).any(-1)
        if bool(differ.any()):
            changed = value.clone()
            changed[0] = value[int(differ.to(torch.uint8).argmax())]
            return changed
    flat = value.reshape(-1)
    differ = flat != flat[0]
    if flat.numel() < 2 or not bool(differ.any()):
        return None
    changed = flat.clone()
    changed[0] = flat[int(differ.to(torch.uint8).argmax())]
    return changed.reshape(value.shape)


def _read_by_values(replayed, args, kwargs, place, trace, start):
    """``(site, compared)``: the first site whose density at the values of ``trace`` (a run
    of ``replayed`` on the data as given, from the random state ``start``) moves when the
    tensor at ``place`` is perturbed (:func:`_perturbed`), else None; ``compared`` when the
    model ran on the perturbed data."""
    changed = _perturbed(_at(args, kwargs, place))
    if changed is None:
        return None, False
    changed_args, changed_kwargs = _replaced(args, kwargs, place, changed)
    start.restore()  # draws made inside the model (dropout) repeat in both runs
    try:
        again = poutine.trace(replayed).get_trace(*changed_args, **changed_kwargs)
    except Exception:  # the model cannot run on these data: nothing to tell
        return None, False
    for name in _compared_sites(trace):
        site = trace.nodes[name]
        if name not in again.nodes:
            continue
        value = site["value"]
        before, after = _log_density(site, value), _log_density(again.nodes[name], value)
        if before is None or after is None or before.shape != after.shape:
            continue
        finite = torch.isfinite(before) & torch.isfinite(after)
        moved = (before - after).abs() > _TOLERANCE * (1 + before.abs())
        appeared = torch.isfinite(before) != torch.isfinite(after)
        if bool((moved & finite).any()) or bool(appeared.any()):
            return name, True
    return None, True


def _find_data_read(model, args, kwargs):
    """``(found, compared)``: ``found`` as :func:`data_read_by` returns it, and whether
    some argument was found to be the data and compared: a verdict that later calls with
    other data would repeat."""
    with same_random_state(), pyro.validation_enabled(False):
        with torch.no_grad():
            drawn = poutine.trace(model).get_trace(*args, **kwargs)
            replayed = poutine.replay(model, trace=drawn)
            start = RandomState()
            trace = poutine.trace(replayed).get_trace(*args, **kwargs)
        places = _tensor_places(args, kwargs)
        verdicts = {}  # place: whether the observed values are computed from it (None: unknown)
        for place in places:
            if _at(args, kwargs, place).is_floating_point():
                name, verdicts[place] = _read_by_gradients(replayed, args, kwargs, place)
                if name is not None:
                    return (name, place[0]), True
        # By values: the arguments found to be the data, and, where none was, those observed
        # as they are (integer data; a model that cuts the gradient with detach() or
        # torch.no_grad). An argument that is not the data when another is, is a covariate,
        # whatever its values.
        found_data = any(verdicts.values())
        observed = [drawn.nodes[name]["value"] for name in observed_names_in(drawn)]
        compared = found_data
        for place in places:
            value, is_data = _at(args, kwargs, place), verdicts.get(place)
            if not is_data and (
                found_data or not any(_same_values(value, seen) for seen in observed)
            ):
                continue
            with torch.no_grad():
                name, ran = _read_by_values(replayed, args, kwargs, place, trace, start)
            compared = compared or ran
            if name is not None:
                return (name, place[0]), True
    return None, compared


def _same_values(value, seen):
    return value is seen or (
        torch.is_tensor(seen)
        and value.shape == seen.shape
        and value.dtype == seen.dtype
        and torch.equal(value, seen)
    )


def data_read_by(model, args, kwargs):
    """The name of the first latent, observed or ``pyro.factor`` site of ``model`` whose
    distribution reads the data it observes (see the module's docstring), and the argument
    that holds the data (a position or a keyword): ``(site, argument)``, or ``None``. The
    latents are drawn once and replayed; torch's random state is then left as it was
    found."""
    return _find_data_read(model, args, kwargs)[0]


def check_data_not_read(model, args, kwargs, what):
    """Raises ``ValueError`` when a distribution of ``model`` reads the data it observes
    (:func:`data_read_by`): ``what`` (the caller, in words) would score or draw from
    conditionals that take the masked entries' own values as known. Once per model and
    argument shapes."""
    if _PASSED.seen(model, None, args, kwargs, None):
        return
    found, compared = _find_data_read(model, args, kwargs)
    if found is None and compared:
        return
    # Refused, or nothing seen to compare (no argument found to be the data, or constant
    # data): later calls with these shapes are checked again.
    _PASSED.forget(model, None, args, kwargs, None)
    if found is None:
        return
    site, key = found
    argument = f"positional argument {key}" if isinstance(key, int) else f"keyword argument {key!r}"
    raise ValueError(
        f"{what} needs the conditionals p(x_j | x_R) of masked inputs, but the distribution "
        f"of site {site!r} changes when the data the model observes (its {argument}) "
        f"change, every latent held fixed: it is computed from the data itself (e.g. an "
        f"autoregressive term such as a * x[..., :-1], a mean of the batch, a "
        f"pyro.factor on the data, or an encoder of the data inside the model). Its "
        f"conditionals would take each masked entry's own value as known, and come out "
        f"wrong. Write the dependence "
        f"between features through latents, so that no distribution reads the observed "
        f"values. log_marginal and MPTLoss(rate='uniform') stay exact for such a model: "
        f"their totals do not depend on how p(x) splits into conditionals."
    )
