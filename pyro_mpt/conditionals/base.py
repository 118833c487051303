"""The interface every self-predictive conditional strategy implements."""

import math
from abc import ABC, abstractmethod

__all__ = ["Conditionals", "SelfPredictive"]


class SelfPredictive(ABC):
    """The self-predictive conditionals ``p(x_j | x_R)`` of one batch of observations.

    Built by :meth:`Conditionals.prepare` from one run of the model; :meth:`log_prob` then
    scores any number of masks in one vectorized call.

    :ivar observed: the :class:`~pyro_mpt.infer.trace_utils.ObservedSite` being scored.
    :ivar scale: the log-probability scale per observation (plate subsampling).
    :ivar extra_log_prob: the model's ``pyro.factor`` terms that do not depend on the local
        latents, summed and scaled (added to the loss as ``Trace_ELBO`` adds them).
    :ivar diagnostics: the accuracy figures of the last :meth:`log_prob` or
        :meth:`log_marginal` call of an approximate strategy (e.g.
        :class:`~pyro_mpt.conditionals.importance.ImportanceDiagnostics`); None for
        strategies whose conditionals are exact for their rule.
    """

    diagnostics = None

    def __init__(self, observed, scale, extra_log_prob=0.0):
        self.observed = observed
        self.scale = scale
        self.extra_log_prob = extra_log_prob

    def context(self, masks):
        """The entries each mask leaves visible: not masked, and not missing."""
        entries = self.observed.entries
        return ~masks if entries is None else ~masks & entries

    @property
    def num_features(self):
        """The number of features ``D`` of one observation."""
        return self.observed.value.shape[-1]

    @property
    def batch_shape(self):
        """The shape of the batch of observations."""
        return self.observed.batch_shape

    @abstractmethod
    def log_prob(self, masks):
        """``log p(x_j | x_R)`` for every feature ``j``, with ``R`` the unmasked features.

        :param torch.Tensor masks: boolean, ``True`` at masked features; shape
            ``(P,) + batch_shape + (D,)``, or ``(P,) + (1,) * len(batch_shape) + (D,)`` to
            share masks across the batch.
        :returns: a tensor of shape ``(P,) + batch_shape + (D,)``; entries at unmasked
            features are finite and meaningless. Missing entries (a mask on the observed
            site) are never part of the context.
        """
        raise NotImplementedError

    def proposal_loss(self):
        """A loss that trains the guide as a proposal for ``p(z | x_R)`` from the samples of
        the last :meth:`log_prob` call, or None for strategies that draw nothing from the
        guide. ``MPTLoss(guide_loss="wake")`` trains the guide's parameters on it."""
        return None

    def log_marginal(self):
        """``log p(x)`` of each observation (of its observed entries), ``batch_shape``.

        :raises NotImplementedError: for strategies that give no log-marginal likelihood.
        """
        raise NotImplementedError(
            f"{type(self).__name__} gives no log-marginal likelihood; use exact conditionals, "
            f"a Quadrature rule, or Importance."
        )


class Conditionals(ABC):
    """A strategy that computes self-predictive conditionals for a Pyro model.

    Strategies are configured in their constructor; :class:`~pyro_mpt.conditionals.Auto`
    also remembers which strategy it chose for a model.
    """

    #: The name accepted by ``MPTLoss(conditionals=...)``.
    name = None
    #: What ``MPTLoss(guide_loss="auto")`` trains the guide by under this strategy: None
    #: when the strategy does not use the guide.
    guide_loss = None

    @abstractmethod
    def prepare(self, model, guide, args, kwargs, max_plate_nesting=math.inf):
        """Runs the model (and the guide, if the strategy needs one) on a batch of data.

        :returns: a :class:`SelfPredictive` for the batch.
        :raises pyro_mpt.errors.NotApplicableError: if the strategy does not apply to this
            model.
        """
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}()"
