"""Checks that a model run at many latent values at once scores each value as the model run
alone does.

Quadrature, the exact path's probes, importance sampling and encoding–decoding run the
user's model once with extra batch dims left of its plates (one over latent points, or one
over samples and one over masks), as Pyro's vectorized particles do. A model that does not
broadcast over leading dims may still run without error and give wrong numbers: an operation
over a fixed positive dim (``softmax(..., dim=1)``, ``x.shape[0]``, ``reshape(N, ...)``)
acts on another dim once dims are added on the left. So, once per model structure, the
vectorised run is compared with plain runs of the model, ``poutine.condition``-ed on the
latent values that the vectorised run had at a few of its points, as a user would run it:
the observed site's per-entry log-likelihood and each latent site's log-density must agree.

The cost falls on the first call only. The points path compares the run at the first of
the two check points that its first call per
:class:`~pyro_mpt.trace.model_structure.ModelStructure` makes anyway: one plain model run
more. The guided path runs the guide and the model once at two
samples of two copies of the data, and the model plainly once, at the second sample of the
second copy (an operation over a leading dim mixes that point with the others, so one point
shows it); the other copies hold the first copy's draws with the two samples swapped at
some observations (:func:`kept_patterns`), so the same run shows a likelihood that reads
another observation's latent or a statistic of the batch's. This runs on the first call
for each model, guide and argument shapes; it remembers those by weak reference
(:class:`CheckedCalls`), so later steps only look them up.
"""

import collections
import weakref

import pyro
import pyro.poutine as poutine
import torch
from pyro.poutine.util import site_is_subsample

from pyro_mpt.trace.remembered_structure import described
from pyro_mpt.trace.trace_utils import (
    distribution_mask,
    param_store_rollback,
    same_random_state,
    unwrap_independent,
)

__all__ = [
    "CheckedCalls",
    "batch_norm_hint",
    "check_guided_run",
    "check_run_at_points",
    "compare_with_plain_runs",
    "kept_patterns",
    "mixing_message",
    "no_feature_dim_advice",
    "tolerance",
]

_FIX = (
    "The model must broadcast over extra leading dims: an operation over a fixed positive dim "
    "acts on another dim once dims are added on the left (softmax(..., dim=1), x.shape[0], "
    "reshape(N, ...), torch.cat(..., dim=1), z[:, 0]). Count dims from the right: "
    "softmax(..., dim=-1), x.shape[-2], z.reshape(z.shape[:-1] + (...)), "
    "torch.cat(..., dim=-1), z[..., 0]."
)


def tolerance(dtype):
    """The largest disagreement allowed between a vectorised and a plain run, relative to
    ``1 + |log p|`` of the plain run: ``1e-5`` in float64, ``10 sqrt(eps)`` in lower
    precision (``3.5e-3`` in float32).

    A run at many latent values may take other kernels than a run at one (another blocking
    of a batched matrix product, another convolution algorithm, TF32 on a GPU), so the two
    differ by the rounding of the decoder's intermediate values: about ``eps`` per operation
    on CPUs, up to ``1e-3`` of a logit under TF32's 10-bit mantissa, which moves a
    log-probability by at most that much times its own size plus one. Broadcasting mistakes
    move log-probabilities by whole nats, orders of magnitude above either bound.

    :param torch.dtype dtype: the dtype of the log-probabilities compared.
    """
    return max(1e-5, 10 * torch.finfo(dtype).eps ** 0.5)


def _entry_log_prob(site):
    """The per-entry log-density of a site, its base distribution's ``log_prob`` at its
    value, and how many of its dims lie right of the plates (``.to_event`` dims)."""
    fn = site["fn"]
    base = unwrap_independent(fn)
    return base.log_prob(site["value"]), len(fn.event_shape) - len(base.event_shape)


def _counted(site, num_right):
    """Booleans that broadcast to the site's per-entry log-density, ``False`` where a mask
    (``poutine.mask``, ``.mask(...)``) says the entry does not count; or None."""
    fn = site["fn"]
    mask = distribution_mask(fn)
    if mask is not None:
        num_base = len(unwrap_independent(fn).event_shape)
        if num_base:
            mask = mask.flatten(-num_base).all(-1)
    site_mask = site["mask"]
    if site_mask is not None:
        site_mask = torch.as_tensor(site_mask, dtype=torch.bool)
        site_mask = site_mask.reshape(site_mask.shape + (1,) * num_right)
        mask = site_mask if mask is None else mask & site_mask
    return mask


class _Mismatch(Exception):
    """A vectorised tensor whose shape does not reduce to the plain run's."""


def _at(tensor, index, num_plates, num_right, shape):
    """The slice of a vectorised run's ``tensor`` at ``index`` of its leading dims, shaped as
    the plain run's ``shape``.

    The vectorised tensor has ``len(index)`` leading dims, then the model's ``num_plates``
    plate dims and ``num_right`` dims right of them, possibly broadcast (size one, or
    absent on the left); the plain one has at most ``num_plates`` plate dims.
    """
    total = len(index) + num_plates + num_right
    if tensor.dim() > total:
        raise _Mismatch
    tensor = tensor.reshape((1,) * (total - tensor.dim()) + tuple(tensor.shape))
    tensor = tensor[tuple(i if size > 1 else 0 for i, size in zip(index, tensor.shape))]
    extra = tensor.dim() - len(shape)
    if extra < 0 or any(size != 1 for size in tensor.shape[:extra]):
        raise _Mismatch
    try:
        return tensor.reshape(tensor.shape[extra:]).expand(shape)
    except RuntimeError:
        raise _Mismatch from None


def _disagreement(vectorised, plain, mask):
    """``|a - b| / (1 + |b|)`` per entry: 0 where both are the same infinity or NaN or the
    entry does not count, infinite where only one is finite."""
    same = (vectorised == plain) | (vectorised.isnan() & plain.isnan())
    error = (vectorised - plain).abs() / (1 + plain.abs())
    error = torch.where(same, 0.0, error.nan_to_num(nan=float("inf")))
    if mask is not None:
        error = torch.where(mask, error, 0.0)
    return error


def _shape_error(name, vectorised, plain, how):
    return ValueError(
        f"Site {name!r} has shape {tuple(vectorised.shape)} when {how}, which does not "
        f"reduce to its shape {tuple(plain.shape)} in a plain run of the model at one of "
        f"those latent values. {_FIX}"
    )


def _compare_site(name, vectorised_site, plain_site, index, num_plates, how, observed):
    """:raises ValueError: if the site's per-entry log-density at ``index`` of the
    vectorised run differs from the plain run's beyond :func:`tolerance`."""
    plain, num_right = _entry_log_prob(plain_site)
    vectorised_full, _ = _entry_log_prob(vectorised_site)
    try:
        vectorised = _at(vectorised_full, index, num_plates, num_right, plain.shape)
    except _Mismatch:
        raise _shape_error(name, vectorised_full, plain, how) from None
    mask = _counted(plain_site, num_right)
    error = _disagreement(vectorised, plain, mask)
    tol = tolerance(plain.dtype)
    if not error.numel() or float(error.max()) <= tol:
        return
    worst = tuple(int(i) for i in torch.unravel_index(error.argmax(), error.shape))
    kind = "log-likelihood" if observed else "log-density"
    difference = vectorised - plain
    if mask is not None:
        difference = torch.where(mask, difference, 0.0)
    summed = difference.sum(tuple(range(-num_right, 0))) if num_right else difference
    summed = summed.nan_to_num(nan=float("inf")).abs().max()
    raise ValueError(
        f"{'Observed' if observed else 'Latent'} site {name!r} has {kind} "
        f"{float(vectorised[worst]):.6g} at entry {worst} when {how}, but "
        f"{float(plain[worst]):.6g} when the model runs alone at the same latent values "
        f"(poutine.condition on one point): they differ by "
        f"{float(difference[worst].abs()):.3g} nats there and by up to {float(summed):.3g} "
        f"nats per observation (tolerance {tol:.1e} relative to 1 + |log p|), so every "
        f"integral of the latents would be silently wrong. {_FIX}"
    )


def _point_values(trace, structure, index):
    """The plain run's ``condition`` data: each latent (and missing-entry) site's value in
    the vectorised run at ``index``, shaped as in the structure trace, and the subsample of
    every subsampled plate, so the plain run sees the same observations."""
    num_plates = structure.max_plate_nesting
    data = {}
    for name in structure.latent_names + tuple(structure.missing_names):
        first = structure.trace.nodes[name]
        value = trace.nodes[name]["value"]
        try:
            data[name] = _at(
                value, index, num_plates, len(first["fn"].event_shape), first["value"].shape
            )
        except _Mismatch:
            raise _shape_error(name, value, first["value"], "the values are read") from None
    for name, site in trace.nodes.items():
        if site["type"] == "sample" and site_is_subsample(site):
            data[name] = site["value"]
    return data


def compare_with_plain_runs(model, args, kwargs, structure, trace, indices, how):
    """Compares a vectorised run of ``model`` with plain runs at some of its points.

    For each index into the run's leading dims, the model runs once with no extra plate,
    conditioned on the latent values the vectorised run had there; the observed site's
    per-entry log-likelihood and each latent site's log-density must agree with the
    vectorised run's at that index. Nothing here touches the caller's random state or
    builds a graph.

    :param callable model: the model, run as ``model(*args, **kwargs)``.
    :param structure: its :class:`~pyro_mpt.trace.model_structure.ModelStructure`.
    :param trace: the vectorised run's trace: every site has leading dims, one per entry of
        each index, left of the model's ``structure.max_plate_nesting`` plate dims.
    :param list indices: tuples indexing the leading dims, one per point to compare.
    :param str how: how the vectorised run came about, for the error message (e.g.
        ``"MPTLoss runs the model at several latent values at once"``).
    :raises ValueError: naming the site, the size of the disagreement, the likely cause
        and the fix.
    """
    num_plates = structure.max_plate_nesting
    names = (structure.observed.name,) + structure.latent_names
    try:
        with (
            torch.no_grad(),
            same_random_state(),
            pyro.validation_enabled(False),
        ):
            for index in indices:
                conditioned = poutine.condition(model, data=_point_values(trace, structure, index))
                plain = poutine.trace(conditioned).get_trace(*args, **kwargs)
                for name in names:
                    _compare_site(
                        name,
                        trace.nodes[name],
                        plain.nodes[name],
                        index,
                        num_plates,
                        how,
                        observed=name == structure.observed.name,
                    )
    except ValueError as error:
        hint = batch_norm_hint(model, args, kwargs)
        if not hint or _FIX not in str(error):
            raise
        raise ValueError(str(error).replace(_FIX, hint)) from error


def batch_norm_hint(model, args, kwargs, who="model"):
    """Advice on the BatchNorm layers that a plain run of ``model`` calls, or ``""`` if it
    calls none: the likely cause of a model that misbehaves when run with extra leading dims.

    :param callable model: the model (or guide), run as ``model(*args, **kwargs)``.
    :param str who: what ``model`` is, for the message: ``"model"`` or ``"guide"``.

    The run leaves no trace: it is blocked, draws from a forked random state, restores the
    param store and the layers' running statistics, and any error it raises is ignored.
    """
    seen = {}

    def remember(module, inputs):
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and id(module) not in seen:
            buffers = {k: v.clone() for k, v in module.named_buffers(recurse=False)}
            seen[id(module)] = (module, buffers)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(remember)
    try:
        with (
            torch.no_grad(),
            same_random_state(),
            poutine.block(),
            param_store_rollback(always=True),
        ):
            model(*args, **kwargs)
    except Exception:  # noqa: BLE001 -- only the layers it reached matter here
        pass
    finally:
        handle.remove()
        for module, buffers in seen.values():
            for key, value in buffers.items():
                getattr(module, key).copy_(value)
    if not seen:
        return ""
    layers = ", ".join(
        f"{type(m).__name__}({m.num_features}) in {'training' if m.training else 'eval'} mode"
        for m, _ in seen.values()
    )
    return (
        f"The {who} calls {layers}. A BatchNorm layer reads dim 1 of its input as the "
        f"channels (BatchNorm1d takes (N, C) or (N, C, L)), so the extra batch dims that "
        f"MPTLoss adds on the left (latent points, or samples and masks) make it normalise "
        f"the wrong dim (a 3-D input (Q, N, C) is read as N channels of length C) or fail on "
        f"the size; in training mode it also normalises over the batch, mixing observations "
        f"and latent values. Call .eval() on it (running statistics: each row alone) and "
        f"give it the features in 2-D, leading dims merged and restored: "
        f"norm(h.reshape(-1, h.shape[-1])).reshape(h.shape) (BatchNorm2d: "
        f"h.reshape((-1,) + h.shape[-3:])); or use nn.LayerNorm(C), which normalises each "
        f"row on its own over its last dim."
    )


def check_run_at_points(model, args, kwargs, structure, trace, points):
    """Compares a run of ``model`` at whitened points with a plain run at some of them.

    :param trace: the run's trace (:mod:`~pyro_mpt.trace.whitened_latents`), whose sites
        have one leading dim over the points, left of the model's plates.
    :param list points: the indices of the points to compare (an operation over a leading
        dim mixes every point with the others, so one point shows it).
    :raises ValueError: as :func:`compare_with_plain_runs`.
    """
    how = (
        "MPTLoss runs the model at several latent values at once (an extra batch dim left "
        "of its plates, as Pyro's vectorized particles do)"
    )
    indices = [(q,) for q in points]
    compare_with_plain_runs(model, args, kwargs, structure, trace, indices, how)


def _reference(value):
    """A reference to ``value`` that keeps it alive only if it cannot be referenced weakly."""
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: value


class CheckedCalls:
    """The (model, guide, argument shapes) calls already checked, most recent last.

    Objects are recorded by ``id`` and confirmed by weak reference, so the record keeps no
    model, guide or data alive and a new object that reuses a freed one's ``id`` is new.
    """

    def __init__(self, size=64):
        self.size = size
        self._entries = collections.OrderedDict()

    @staticmethod
    def _parts(model, guide, args, kwargs, max_plate_nesting):
        objects, description = [], []
        for fn in (model, guide):
            objects += [getattr(fn, "__func__", fn), getattr(fn, "__self__", None)]
        for value in list(args) + [kwargs[k] for k in sorted(kwargs)]:
            if torch.is_tensor(value):
                description.append((tuple(value.shape), value.dtype, value.device))
            elif type(value) in (dict, list, tuple):
                description.append(described(value))  # a batch as a dict of tensors
            else:
                objects.append(value)
        key = (
            tuple(id(o) for o in objects),
            tuple(description),
            tuple(sorted(kwargs)),
            max_plate_nesting,
        )
        return key, objects

    def seen(self, *call):
        """Whether this call was recorded; it is recorded from now on."""
        key, objects = self._parts(*call)
        references = self._entries.get(key)
        if references is not None and all(r() is o for r, o in zip(references, objects)):
            self._entries.move_to_end(key)
            return True
        self._entries[key] = [_reference(o) for o in objects]
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return False

    def forget(self, *call):
        """Drops the record of a call (one whose check failed)."""
        self._entries.pop(self._parts(*call)[0], None)


_CHECKED = CheckedCalls()


def check_guided_run(guided, what):
    """Compares the model replayed at a guide's samples (two samples of two copies of the
    full data, through :func:`~pyro_mpt.trace.guided_model.run_guided`) with a plain run at
    the second sample of the second copy; once per model, guide and argument shapes.

    :param guided: a :class:`~pyro_mpt.trace.guided_model.GuidedModel`.
    :param str what: the strategy's name, for the error message.
    :raises ValueError: as :func:`compare_with_plain_runs`.
    """
    from pyro_mpt.trace.guided_model import run_guided  # it calls this check

    local = guided.local
    call = (guided.model, guided.guide, guided.args, guided.kwargs, local.max_plate_nesting)
    if _CHECKED.seen(*call):
        return
    value = local.observed.value
    how = (
        f"conditionals={what!r} runs the model at the guide's samples (two extra batch "
        f"dims left of its plates, over samples and masks, as Pyro's vectorized particles do)"
    )
    try:
        with torch.no_grad(), same_random_state():
            # Copies of the data: the first for the draws, one per row of kept_patterns.
            num_copies = 1 + len(kept_patterns(local.observed.batch_shape.numel()))
            filled = value.expand((num_copies,) + value.shape)
            drawn, _ = run_guided(guided, filled, 2, replay_model=False)
            _check_guide_broadcasts(guided, drawn, filled.shape)
            swapped = _kept_copies(local, drawn)
            _, trace = run_guided(guided, filled, 2, guide_trace=swapped or drawn)
        compare_with_plain_runs(
            guided.model, guided.args, guided.kwargs, local, trace, [(1, 1)], how
        )
        if swapped is not None:
            _check_local_draws(local, trace)
    except ValueError as error:
        _CHECKED.forget(*call)
        if local.observed.num_feature_dims or _FIX not in str(error):
            raise
        # x.shape[-2], the advice of _FIX, counts observations only with a feature dim.
        fix = f"{_FIX} {no_feature_dim_advice(local.observed)}."
        raise ValueError(str(error).replace(_FIX, fix)) from error
    except BaseException:
        _CHECKED.forget(*call)
        raise


def _check_guide_broadcasts(guided, drawn, data_shape):
    """Raises when the guide, run on copies of the data (two samples, ``data_shape``), draws
    a latent whose shape past those two leading dims is not the model's in a plain run: a
    guide that sizes its data plate from the left (``x.shape[0]``) reads the copies as the
    observations, and the error would otherwise be blamed on the model."""
    from pyro_mpt.trace.guided_model import describe_guide  # it imports this module

    for name in guided.local.latent_names:
        site = drawn.nodes.get(name)
        if site is None:
            continue  # the guide's own check names a missing site
        shape, expected = site["value"].shape, guided.local.trace.nodes[name]["value"].shape
        # Dims of size one between the two leading ones and the model's shape: a
        # max_plate_nesting above the model's own puts the leading dims further left.
        rest = shape[2:]
        while len(rest) > len(expected) and rest[0] == 1:
            rest = rest[1:]
        try:
            fits = torch.broadcast_shapes(rest, expected) == expected
        except RuntimeError:
            fits = False
        if not fits:
            observed = guided.local.observed
            extra = "" if observed.num_feature_dims else f" {no_feature_dim_advice(observed)}."
            raise ValueError(
                f"The guide {describe_guide(guided.guide)!r} samples site {name!r} with shape "
                f"{tuple(shape)} when run on {data_shape[0]} copies of the data (a data "
                f"argument of shape {tuple(data_shape)}) under a plate of 2 samples, where "
                f"the model's site has shape {tuple(expected)} for each sample and copy. The "
                f"guide must broadcast over extra leading dims of its data, as the model "
                f"does: size the data plate from the right (x.shape[-2], not x.shape[0]) and "
                f"reshape with x.shape[:-1] rather than the data size.{extra}"
            )


def mixing_message(observed_name):
    """The error for a model whose likelihood of an observation depends on the latent
    values of the others."""
    return (
        f"The likelihood of observed site {observed_name!r} at one latent value changes when "
        f"the model runs at other values too: the model mixes values across its batch "
        f"(another observation's latent, as in a random walk or a moving average over the "
        f"data plate written with cumsum or a shift; batch normalization in training mode; "
        f"latents centred over the batch?). MPTLoss needs p(x_i | z_i) of each observation "
        f"and latent value alone: call .eval() on BatchNorm modules, or use a normalization "
        f"without batch statistics (LayerNorm), and compute nothing across the data plate "
        f"from the latents. A sequence whose steps share latents is one observation: put "
        f"its steps in the features (a plate right of the data plate, or .to_event)."
    )


def kept_patterns(count):
    """Which of ``count`` observations keep their latent value in each slice of the check
    for mixing across the batch: booleans ``(2 B, count)`` with ``B = ceil(log2 count)``,
    row ``2 b + v`` ``True`` where bit ``b`` of the observation's index is ``v``. Any two
    observations differ in some bit, so in some row one keeps its value while the other's
    changes: a likelihood that depends on another observation's latent moves there,
    whichever observations they are."""
    bits = max(1, (count - 1).bit_length())
    index = torch.arange(count)
    rows = [((index >> b) & 1) == v for b in range(bits) for v in (0, 1)]
    return torch.stack(rows)


def _observation_index(shape, data_dims, num_right):
    """The index of each observation (over the data plates ``data_dims``, the leftmost
    slowest) in a tensor of ``shape`` whose plate dims end ``num_right`` dims from the
    right: a long tensor that broadcasts to it, right-aligned."""
    index = torch.zeros((), dtype=torch.long)
    for dim in sorted(data_dims):
        position = dim - num_right
        if -position > len(shape):
            continue
        size = shape[position]
        index = index * size + torch.arange(size).reshape((size,) + (1,) * (-position - 1))
    return index


def _kept_at(patterns, shape, local, num_right):
    """:func:`kept_patterns` laid out for a tensor of ``shape`` whose two leading dims are
    the samples and the copies of the data: row ``r`` is for copy ``r + 1``, shape
    ``(1, 2 B) + ...`` broadcasting to the copies past the first."""
    index = _observation_index(shape[2:], local.data_dims, num_right)
    kept = patterns[:, index]  # (2 B,) + index.shape
    return kept.reshape((1,) + kept.shape[:1] + (1,) * (len(shape) - 2 - index.dim()) + index.shape)


def _kept_copies(local, drawn):
    """The guide's trace ``drawn`` (two samples of ``1 + 2 B`` copies of the data) with every
    copy but the first holding the first copy's draws, the two samples swapped at the
    observations that the copy's row of :func:`kept_patterns` does not keep (each
    observation keeps all its latents from one sample); ``None`` where a latent is not drawn
    per sample and copy (nothing to compare)."""
    patterns = kept_patterns(local.observed.batch_shape.numel())
    lead = (2, 1 + len(patterns))
    swapped = drawn.copy()
    for name in local.latent_names:
        site = drawn.nodes.get(name)
        if site is None or site["value"].dim() < 2 or tuple(site["value"].shape[:2]) != lead:
            return None
        value, num_event = site["value"], len(site["fn"].event_shape)
        index = _observation_index(value.shape[2:], local.data_dims, num_event)
        if index.numel() != patterns.shape[1]:
            return None  # the guide's plates do not fit the data: its own check says so
        kept = _kept_at(patterns, value.shape, local, num_event).to(value.device)
        first = value[:, :1]
        copies = torch.where(kept, first, first.flip(0))
        swapped.nodes[name] = dict(site, value=torch.cat([first, copies], 1))
    return swapped


def _check_local_draws(local, trace):
    """Raises the error of :func:`mixing_message` when an observation's densities in the
    model's run at :func:`_kept_copies`'s latents are not those of the sample it holds: at
    the observations a copy keeps, they must be the first copy's. A likelihood that reads
    another observation's latent, or a statistic of the batch's (a mean over the data
    plate, batch normalization), moves in the copy where that latent changes."""
    patterns = kept_patterns(local.observed.batch_shape.numel())
    for name in (local.observed.name,) + local.latent_names:
        log_prob, num_right = _entry_log_prob(trace.nodes[name])
        if log_prob.dim() < 2 or tuple(log_prob.shape[:2]) != (2, 1 + len(patterns)):
            continue
        kept = _kept_at(patterns, log_prob.shape, local, num_right).to(log_prob.device)
        first, others = log_prob[:, :1], log_prob[:, 1:]
        mask = _counted(trace.nodes[name], num_right)
        mask = kept if mask is None else kept & mask.expand(log_prob.shape)[:, 1:]
        error = _disagreement(others, first.expand_as(others), mask.expand_as(others))
        if bool((error > tolerance(others.dtype)).any()):
            raise ValueError(mixing_message(local.observed.name))


def no_feature_dim_advice(observed):
    """How to size plates for data with no feature dim, where ``x.shape[-2]`` is not the
    number of observations: make the data ``(N, 1)`` and observe it with ``.to_event(1)``.

    :param observed: the model's :class:`~pyro_mpt.trace.observed_site.ObservedSite`.
    """
    shape = tuple(observed.batch_shape)
    return (
        f"Observed site {observed.name!r} has no feature dim (data of shape {shape}), so "
        f"x.shape[-2] is not its number of observations: pass the data as shape "
        f"{shape + (1,)} (x.unsqueeze(-1)), observe it with .to_event(1) (e.g. "
        f"dist.Normal(loc, scale).to_event(1) with loc of shape (..., N, 1)), and size the "
        f"data plate with x.shape[-2] in the model and the guide"
    )
