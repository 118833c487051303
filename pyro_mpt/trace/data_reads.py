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
value of one run, for each tensor argument (inside a dict, list or tuple too):

* **by gradients**, for a floating argument: its entries that the observed values are
  computed from, through any computation (``obs=x / 10``, ``obs=x.T``,
  ``obs=x.nan_to_num()``, a subsample), are the data; a distribution reads them when its
  density at the run's values has a gradient with respect to one. This sees a read whose
  effect happens to cancel on these data (a permutation-invariant statistic, constant
  data), and it leaves alone a covariate column that shares the tensor with the data;
* **by values**, for every argument (integer data; reads with no gradient: comparisons,
  ``detach``, ``torch.no_grad``): the model runs again with one observation's data entries
  replaced by another's; where the observed values move, the argument holds data, and a
  density of the first run's values that moves reads them.

An argument that enters the observed value beside the data (``obs=x / s``) counts as data.
Data the model takes from elsewhere (a closure, an attribute), and a lagged copy of the
data passed as an argument of its own, cannot be told from a covariate and are not
checked.
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


def _rebuilt(value, items):
    """A container of ``value``'s type holding ``items``, or a plain tuple of them for a
    tuple subclass that cannot be built from one iterable (one whose constructor takes its
    fields one by one): a model that unpacks it runs the same."""
    if isinstance(value, list):
        return items
    if hasattr(value, "_make"):  # a namedtuple
        return type(value)._make(items)
    try:
        return type(value)(items)
    except TypeError:
        return tuple(items)


def _replaced(args, kwargs, places, new):
    """Copies of ``args`` and ``kwargs`` with the tensor at each of ``places`` replaced by
    ``new(tensor, place)``; the containers on the way are copied, the user's are left as
    they are."""

    def put(value, key, path):
        if torch.is_tensor(value):
            return new(value, (key, path)) if (key, path) in places else value
        if isinstance(value, dict):
            return {inner: put(item, key, path + (inner,)) for inner, item in value.items()}
        if isinstance(value, (list, tuple)):
            items = [put(item, key, path + (inner,)) for inner, item in enumerate(value)]
            return _rebuilt(value, items)
        return value

    args = [put(value, key, ()) for key, value in enumerate(args)]
    kwargs = {key: put(value, key, ()) for key, value in kwargs.items()}
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


def _gradient(tensors, leaf):
    """The gradient with respect to ``leaf`` of a sum of ``tensors`` with fixed weights
    between 0.5 and 1.5 (so that no two paths cancel), or None where none of them is
    computed from it."""
    total = 0.0
    weights = torch.Generator().manual_seed(0)
    for tensor in tensors:
        if torch.is_tensor(tensor) and tensor.requires_grad:
            weight = torch.rand(tensor.shape, generator=weights, dtype=torch.float64) + 0.5
            total = total + (weight.to(tensor) * tensor).sum()
    if not torch.is_tensor(total):
        return None
    try:
        return torch.autograd.grad(total, leaf, allow_unused=True, retain_graph=True)[0]
    except RuntimeError:  # an operation with no derivative on the way: no known path
        return None


def _read_by_gradients(replayed, args, kwargs, place):
    """``(site, entries)``: the first site whose density at the run's values has a
    gradient with respect to an entry of the floating tensor at ``place`` that an observed
    value is computed from, else None; and those entries (booleans of the tensor's shape),
    or None where the observed values are not computed from it or the model cannot run with
    a tensor that requires grad. Entries that only the densities read (a covariate column
    beside the data in one tensor) are no data."""
    # Callers may run under torch.no_grad or inference mode.
    with torch.inference_mode(False), torch.enable_grad():
        leaf = _at(args, kwargs, place).detach().clone().requires_grad_()
        try:
            # A copy that is no leaf: a model that writes into its data in place can.
            copied = _replaced(args, kwargs, [place], lambda *_: leaf.clone())
            trace = poutine.trace(replayed).get_trace(*copied[0], **copied[1])
            observed = [trace.nodes[name]["value"] for name in observed_names_in(trace)]
            into_observed = _gradient(observed, leaf)
            if into_observed is None:
                return None, None
            entries = into_observed != 0
            if not bool(entries.any()):  # computed from it, through zero derivatives
                entries = torch.ones_like(entries)
            for name in _compared_sites(trace):
                site = trace.nodes[name]
                value = site["value"].detach() if torch.is_tensor(site["value"]) else None
                read = _gradient([_log_density(site, value)], leaf)
                if read is not None and bool((read[entries] != 0).any()):
                    return name, entries
        except Exception:
            return None, None
    return None, entries


def _perturbed(value, entries=None):
    """``value`` with the ``entries`` (default: all) of its first observation replaced by
    those of the first observation that differs there (or, for one observation, its first
    such entry by another of their values): values the data hold, so valid for any
    likelihood the data were valid for, and not a permutation, so a statistic of the whole
    data (a mean, a sum) moves too. None for data constant there."""
    if entries is None:
        entries = torch.ones(value.shape, dtype=torch.bool, device=value.device)
    if value.dim() > 1 and value.shape[0] > 1:
        rows, kept = value.reshape(value.shape[0], -1), entries.reshape(value.shape[0], -1)
        differ = ((rows != rows[:1]) & kept[:1]).any(-1)
        if bool(differ.any()):
            changed = rows.clone()
            changed[0] = torch.where(kept[0], rows[int(differ.to(torch.uint8).argmax())], rows[0])
            return changed.reshape(value.shape)
    flat, kept = value.reshape(-1), entries.reshape(-1)
    if int(kept.sum()) < 2:
        return None
    first = int(kept.to(torch.uint8).argmax())
    differ = (flat != flat[first]) & kept
    if not bool(differ.any()):
        return None
    changed = flat.clone()
    changed[first] = flat[int(differ.to(torch.uint8).argmax())]
    return changed.reshape(value.shape)


def _read_by_values(replayed, args, kwargs, place, trace, start, entries=None):
    """``(site, is_data)``: the first site whose density at the values of ``trace`` (a run
    of ``replayed`` on the data as given, from the random state ``start``) moves when the
    ``entries`` of the tensor at ``place`` are perturbed (:func:`_perturbed`), else None;
    and whether the observed values moved with them (the tensor holds data)."""
    changed = _perturbed(_at(args, kwargs, place), entries)
    if changed is None:
        return None, False
    start.restore()  # draws made inside the model (dropout) repeat in both runs
    try:
        changed_args, changed_kwargs = _replaced(args, kwargs, [place], lambda *_: changed)
        again = poutine.trace(replayed).get_trace(*changed_args, **changed_kwargs)
    except Exception:  # the model cannot run on these data: nothing to tell
        return None, False
    moved_observed = False
    for name in observed_names_in(trace):
        before, after = trace.nodes[name]["value"], again.nodes.get(name, {}).get("value")
        if not (torch.is_tensor(after) and after.shape == before.shape):
            moved_observed = True
        elif not torch.equal(before, after):
            moved_observed = True
    if not moved_observed:
        return None, False  # a covariate, whatever the densities do
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
    # The runs see copies: a model that writes into its data in place changes no data of
    # the caller's.
    args, kwargs = _replaced(args, kwargs, _tensor_places(args, kwargs), lambda t, _: t.clone())
    with same_random_state(), pyro.validation_enabled(False):
        with torch.no_grad():
            drawn = poutine.trace(model).get_trace(*args, **kwargs)
            replayed = poutine.replay(model, trace=drawn)
            start = RandomState()
            trace = poutine.trace(replayed).get_trace(*args, **kwargs)
        compared = False
        for place in _tensor_places(args, kwargs):
            entries = None
            if _at(args, kwargs, place).is_floating_point():
                name, entries = _read_by_gradients(replayed, args, kwargs, place)
                if name is not None:
                    return (name, place[0]), True
            # By values too: a read with no gradient (a comparison, detach(), torch.no_grad,
            # integer data) is seen when a perturbation of the data moves a density.
            with torch.no_grad():
                name, is_data = _read_by_values(
                    replayed, args, kwargs, place, trace, start, entries
                )
            compared = compared or is_data or entries is not None
            if name is not None:
                return (name, place[0]), True
    return None, compared


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
    call = (model, None, args, kwargs, None)
    if _PASSED.seen(*call):
        return
    try:
        found, compared = _find_data_read(model, args, kwargs)
    except BaseException:
        _PASSED.forget(*call)
        raise
    if found is None and compared:
        return
    # Refused, or nothing seen to compare (no argument found to be the data, or constant
    # data): later calls with these shapes are checked again.
    _PASSED.forget(*call)
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
        f"their totals do not depend on how p(x) splits into conditionals. If that argument "
        f"is a covariate that also enters the observed value (obs=x / s), compute the "
        f"observed value outside the model and pass it as the data."
    )
