"""Small helpers for reading Pyro traces."""

import contextlib
import random

import numpy as np
import pyro
import pyro.distributions as dist
import torch
from pyro.poutine.util import site_is_subsample

__all__ = [
    "check_points",
    "distribution_mask",
    "flatten_tail",
    "latent_sites",
    "narrow_broadcast_dims",
    "RandomState",
    "param_store_rollback",
    "plate_frames",
    "same_random_state",
    "unwrap_independent",
]


def plate_frames(site):
    """The vectorized plates a site sits in, as a frozenset of ``(name, dim)`` pairs."""
    return frozenset((f.name, f.dim) for f in site["cond_indep_stack"] if f.vectorized)


def _is_sample(site):
    return site["type"] == "sample" and not site_is_subsample(site)


def latent_sites(trace):
    """Names of the unobserved sample sites of a trace, in execution order."""
    return [
        name for name, site in trace.nodes.items() if _is_sample(site) and not site["is_observed"]
    ]


def unwrap_independent(fn, with_mask=False):
    """Strips ``Independent`` (``.to_event``) and ``MaskedDistribution`` (``.mask``) wrappers
    from a distribution.

    :param bool with_mask: return ``(base, mask)`` instead of the base alone, where ``mask``
        is that of the ``.mask(...)`` wrappers as booleans of ``fn``'s batch and event shape,
        or ``None`` when it has none (see :func:`distribution_mask`).
    """
    full_shape = fn.batch_shape + fn.event_shape
    mask = None
    while isinstance(fn, (torch.distributions.Independent, dist.MaskedDistribution)):
        if with_mask and isinstance(fn, dist.MaskedDistribution) and fn._mask is not None:
            level = torch.as_tensor(fn._mask, dtype=torch.bool).expand(fn.batch_shape)
            level = level.reshape(level.shape + (1,) * len(fn.event_shape)).expand(full_shape)
            mask = level if mask is None else mask & level
        fn = fn.base_dist
    return (fn, mask) if with_mask else fn


def distribution_mask(fn):
    """The mask of ``.mask(...)`` wrappers of ``fn`` as booleans of its batch and event
    shape, or ``None`` when it has none."""
    return unwrap_independent(fn, with_mask=True)[1]


class RandomState:
    """A snapshot of the random state a model may draw from: torch's CPU generator, every
    CUDA device's once CUDA is initialised, and Python's and NumPy's global generators (as
    :func:`pyro.set_rng_seed` seeds all three), so that a restore covers wherever the draws
    came from. Restoring it makes the numbers drawn next those that were next when it was
    taken."""

    __slots__ = ("cpu", "cuda", "python", "numpy")

    def __init__(self):
        self.cpu = torch.get_rng_state()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.cuda = torch.cuda.get_rng_state_all() if cuda else None
        self.python = random.getstate()
        self.numpy = np.random.get_state()

    def restore(self):
        """Puts the random state back as it was when the snapshot was taken."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        np.random.set_state(self.numpy)


@contextlib.contextmanager
def same_random_state():
    """Leaves the random state (torch's CPU and CUDA generators, Python's and NumPy's; see
    :class:`RandomState`) as the block found it, whether it returns or raises: checks and
    probes that draw numbers then leave a seeded run's later draws unchanged."""
    state = RandomState()
    try:
        yield
    finally:
        state.restore()


@contextlib.contextmanager
def param_store_rollback(always=False):
    """Leaves Pyro's param store as the block found it if the block raises (no
    half-initialised parameters), and with ``always=True`` also when it returns.

    Parameters the block created are removed. A parameter that existed before gets its own
    tensor back if the block deleted or replaced it (or changed its constraint), so its
    value, its identity and any optimizer state keyed on it are kept; values changed in
    place are not undone. Names keep their order.

    :param bool always: restore the store on success too, not only on failure.
    """
    store = pyro.get_param_store()
    # Read without get_state(), which strips the ``unconstrained`` attribute of the
    # parameters that callers may hold.
    params, constraints = dict(store.named_parameters()), dict(store._constraints)
    try:
        yield
    except BaseException:
        _restore_param_store(store, params, constraints)
        raise
    if always:
        _restore_param_store(store, params, constraints)


def _restore_param_store(store, params, constraints):
    """Puts back exactly ``params`` (name to unconstrained tensor) and their constraints,
    unless the store holds just them already."""
    now = dict(store.named_parameters())
    if list(now) == list(params) and all(
        now[name] is value and store._constraints[name] is constraints[name]
        for name, value in params.items()
    ):
        return
    store.clear()
    store.set_state({"params": params, "constraints": constraints})


def check_points(num_points, latent_dim):
    """Fixed standard-normal points for checking a model at latent values, ``(num_points,
    latent_dim)`` on the CPU: drawn from a seeded generator of their own, so that the
    caller's random stream is untouched and every check sees the same points, whatever
    torch's default device."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    return torch.randn(num_points, latent_dim, generator=generator, device="cpu")


def flatten_tail(tensor, num_dims):
    """Merges the rightmost ``num_dims`` dims into one (a new one if ``num_dims == 0``)."""
    if num_dims == 0:
        return tensor.unsqueeze(-1)
    return tensor.reshape(tensor.shape[: tensor.dim() - num_dims] + (-1,))


def narrow_broadcast_dims(tensor, num_dims):
    """``tensor`` with each broadcast (stride-0) dim among its first ``num_dims`` narrowed
    to size one."""
    for dim in range(num_dims):
        if tensor.stride(dim) == 0 and tensor.shape[dim] > 1:
            tensor = tensor.narrow(dim, 0, 1)
    return tensor
