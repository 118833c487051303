"""``conditionals="auto"``: the first strategy that applies to the model and is accurate
for it."""

import logging
import math
import warnings

import torch

from pyro_mpt.conditionals.base import Conditionals
from pyro_mpt.conditionals.encode_decode import EncodeDecode
from pyro_mpt.conditionals.exact import Exact
from pyro_mpt.conditionals.importance import Importance
from pyro_mpt.conditionals.quadrature import Quadrature
from pyro_mpt.errors import NotApplicableError
from pyro_mpt.infer.model_structure import call_signature

__all__ = ["Auto", "STRATEGIES", "as_conditionals"]

logger = logging.getLogger("pyro_mpt")

#: Strategies by name, for ``conditionals=<name>``. ``"auto"`` tries exact, quadrature and
#: importance; ``"encode-decode"``, an approximation, is selectable by name only.
STRATEGIES = {
    "exact": Exact,
    "quadrature": Quadrature,
    "importance": Importance,
    "encode-decode": EncodeDecode,
}

#: Prior-centred quadrature is taken as accurate when the posterior of nine observations in
#: ten, given all their features, spreads over at least this many nodes per latent dimension
#: (Gauss-Hermite rules on Gaussian-like posteriors: 2.5 keeps the log-marginal error near
#: 1e-3 nats or below, 1.6 leaves it near 0.1).
MIN_EFFECTIVE_NODES_PER_DIM = 2.5


def _describe_model(model):
    name = getattr(model, "__qualname__", None)
    return name if isinstance(name, str) else type(model).__name__


class Auto(Conditionals):
    """Picks the strategy for a model: ``"exact"`` for linear-Gaussian models;
    ``Quadrature(20)`` (nodes under the prior) for latents of dimension up to 3 when its
    nodes resolve the posterior; ``"importance"`` otherwise, when a guide is given; without
    a guide, a quadrature rule with more nodes (within :data:`MAX_NODES` nodes and
    :data:`MAX_LIKELIHOOD_ENTRIES` likelihood entries), with a warning if even that is
    coarse. ``"encode-decode"`` is never picked: it is an approximation, selectable by name.

    The choice and its reason are logged once per model and argument shapes (logger
    ``"pyro_mpt"``, level INFO) and remembered: later calls go straight to the chosen
    strategy, and search again only if it no longer applies.

    :ivar chosen: the strategy used by the last call, or None before the first.
    """

    name = "auto"

    def __init__(self):
        self.chosen = None
        self.reason = None
        self._chosen_for = None
        self._strategies = {}

    def _strategy(self, name):
        if name not in self._strategies:
            self._strategies[name] = STRATEGIES[name]()
        return self._strategies[name]

    def prepare(self, model, guide, args, kwargs, max_plate_nesting=math.inf):
        key = call_signature(model, args, kwargs, max_plate_nesting)
        if self.chosen is not None and key == self._chosen_for:
            state = torch.get_rng_state()
            try:
                return self.chosen.prepare(model, guide, args, kwargs, max_plate_nesting)
            except NotApplicableError:
                torch.set_rng_state(state)  # the model changed: search again
        return self._search(model, guide, args, kwargs, max_plate_nesting, key)

    def _try(self, strategy, model, guide, args, kwargs, max_plate_nesting, reasons):
        """``strategy.prepare(...)``, or None (with the reason kept) when it does not apply.
        A strategy that does not apply leaves the random state as it found it: a seeded call
        draws the same numbers whether or not it searched."""
        state = torch.get_rng_state()
        try:
            return strategy.prepare(model, guide, args, kwargs, max_plate_nesting)
        except NotApplicableError as error:
            torch.set_rng_state(state)
            reasons.append(f"  {strategy.name}: {error}")
            return None

    def _search(self, model, guide, args, kwargs, max_plate_nesting, key):
        reasons = []
        call = (model, guide, args, kwargs, max_plate_nesting, reasons)
        state = torch.get_rng_state()
        for name in ("exact", "quadrature"):
            strategy = self._strategy(name)
            prepared = self._try(strategy, *call)
            if prepared is None:
                continue
            if name == "exact":
                return self._choose(strategy, key, model, "the model is linear-Gaussian", prepared)
            spread = _effective_nodes_per_dim(prepared)
            if spread >= MIN_EFFECTIVE_NODES_PER_DIM:
                return self._choose(
                    strategy, key, model, "its nodes resolve the posterior", prepared
                )
            coarse = (
                f"{strategy!r} is coarse here: the posterior of one observation in ten spreads "
                f"over {spread:.1f} of its nodes per latent dimension"
            )
            reasons.append(f"  quadrature: {coarse}")
            torch.set_rng_state(state)  # as if the coarse rule was never run
            importance = self._strategy("importance")
            prepared = self._try(importance, *call)
            if prepared is not None:
                return self._choose(
                    importance, key, model, f"{coarse}, and a guide is given", prepared
                )
            break
        else:
            importance = self._strategy("importance")
            prepared = self._try(importance, *call)
            if prepared is not None:
                return self._choose(importance, key, model, "a guide is given", prepared)
            raise NotApplicableError(
                "conditionals='auto' found no strategy for this model. Available strategies: "
                "'exact', 'quadrature', 'importance'. Why each does not apply:\n"
                + "\n".join(reasons)
            )
        return self._finer_quadrature(strategy, spread, coarse, key, *call[:5])

    def _finer_quadrature(self, strategy, spread, coarse, key, model, guide, args, kwargs, mpn):
        """A rule with more nodes for a posterior the default rule is coarse for, within a
        node and memory budget; warns when even that is coarse."""
        state = torch.get_rng_state()
        prepared = strategy.prepare(model, guide, args, kwargs, mpn)
        finer = _finer_rule(strategy, prepared, spread)
        if finer is not None:
            torch.set_rng_state(state)
            prepared = finer.prepare(model, guide, args, kwargs, mpn)
            spread = _effective_nodes_per_dim(prepared)
            strategy = finer
            if spread >= MIN_EFFECTIVE_NODES_PER_DIM:
                reason = f"{coarse}; {finer.num_points} nodes per dimension resolve it"
                return self._choose(finer, key, model, reason, prepared)
        warnings.warn(
            f"conditionals='auto' uses {strategy!r} for {_describe_model(model)}, but the "
            f"posterior of one observation in ten spreads over only {spread:.1f} of its nodes "
            f"per latent dimension, so its conditionals are coarse. Give MPTLoss a guide "
            f"(importance sampling then applies), or pass Quadrature(center='guide') with a "
            f"trained guide.",
            stacklevel=5,
        )
        return self._choose(strategy, key, model, "coarse, and nothing else applies", prepared)

    def _choose(self, strategy, key, model, reason, prepared):
        if self.chosen is not strategy or self._chosen_for != key:
            logger.info(
                "conditionals='auto' chose %r for %s: %s.", strategy, _describe_model(model), reason
            )
        self.chosen, self._chosen_for, self.reason = strategy, key, reason
        return prepared


#: The most quadrature nodes ``auto`` uses, and the most entries of the ``(G, N, D)``
#: log-likelihood tensor it lets a finer rule make.
MAX_NODES, MAX_LIKELIHOOD_ENTRIES = 4096, 2**24


def _finer_rule(strategy, prepared, spread):
    """A prior-centred rule with enough nodes per dimension for the posterior's spread, or
    ``None`` when it would exceed :data:`MAX_NODES` or the memory budget."""
    dim = prepared.latent_dim
    observed = prepared.observed
    per_node = (
        1
        if prepared.log_weights.dim() == 1 and not hasattr(prepared, "log_likelihoods")
        else observed.value.numel()
    )
    budget = min(MAX_NODES, MAX_LIKELIHOOD_ENTRIES // max(per_node, 1))
    # The spread grows about as the square root of the nodes per dimension.
    ratio = MIN_EFFECTIVE_NODES_PER_DIM / max(spread, 0.5)
    wanted = math.ceil(1.3 * strategy.num_points * ratio**2)
    num_points = min(wanted, int(budget ** (1.0 / dim) + 1e-9))
    if num_points <= strategy.num_points:
        return None
    return Quadrature(num_points=num_points, max_latent_dim=strategy.max_latent_dim)


def _effective_nodes_per_dim(prepared):
    """The tenth percentile over observations of the effective number of nodes, to the
    power ``1 / K``."""
    with torch.no_grad():
        nodes = prepared.effective_nodes().reshape(-1)
    dim = prepared.latent_dim
    return float(nodes.quantile(0.1)) ** (1.0 / dim)


def as_conditionals(conditionals):
    """Normalises the ``conditionals`` argument: a strategy name or a :class:`Conditionals`.

    :raises ValueError: for an unknown name.
    :raises TypeError: for a value of another type.
    """
    if isinstance(conditionals, Conditionals):
        return conditionals
    if isinstance(conditionals, str):
        if conditionals == "auto":
            return Auto()
        if conditionals in STRATEGIES:
            return STRATEGIES[conditionals]()
        names = ", ".join(repr(n) for n in ["auto", *STRATEGIES])
        raise ValueError(
            f"conditionals={conditionals!r} is not a known strategy. Use one of {names}, or "
            f"pass a pyro_mpt.conditionals.Conditionals instance."
        )
    raise TypeError(
        f"conditionals must be a strategy name or a pyro_mpt.conditionals.Conditionals "
        f"instance, got {conditionals!r} of type {type(conditionals).__name__}."
    )
