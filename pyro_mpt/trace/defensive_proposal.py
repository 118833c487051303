"""Defensive proposals for discrete latents: a guide's categorical or Bernoulli choice mixed
with a uniform one, so that importance sampling tries every value.

An amortized classifier ``q(c | x_fill)`` that puts almost no mass on the component that
explains ``x_R`` never samples it, and the importance estimate of ``p(x_j | x_R)`` is then
off by nats with weights that look healthy (no large k-hat, no low ESS: the missed values
leave no trace in the samples). Mixing ``q`` with the uniform distribution over its support,
``q' = (1 - eps) q + eps / K`` (Hesterberg, 1995), bounds every weight's ratio to ``q'`` by
``K / eps`` times the target's and gives each value a chance of at least ``eps / K`` per
sample. The weights use ``q'``; the guide's own ``q`` is kept for the wake-phase loss.
"""

import pyro.distributions as dist
import torch
from pyro.poutine.messenger import Messenger

__all__ = ["DEFENSIVE_WEIGHT", "DefensiveDiscreteMessenger", "GUIDE_FN", "defensive_discrete"]

#: ``eps``, the weight of the uniform component.
DEFENSIVE_WEIGHT = 0.3
#: The key of ``site["infer"]`` that holds the guide's own distribution of a mixed site.
GUIDE_FN = "_mpt_guide_fn"

_MIXABLE = (dist.Categorical, dist.OneHotCategorical, dist.Bernoulli)


def _mixed(base, weight):
    """``base`` (Categorical, OneHotCategorical or Bernoulli) mixed with the uniform
    distribution on its support, the same family."""
    if isinstance(base, dist.Bernoulli):
        return dist.Bernoulli(probs=(1 - weight) * base.probs + weight / 2)
    num_values = base.probs.shape[-1]
    return type(base)(probs=(1 - weight) * base.probs + weight / num_values)


class DefensiveDiscreteMessenger(Messenger):
    """Replaces the distribution of every unobserved Categorical, OneHotCategorical or
    Bernoulli site (possibly made an event by ``to_event``; a masked site is left as it
    is) by its defensive mixture, and
    keeps the original in ``site["infer"][GUIDE_FN]``.

    :param float weight: ``eps``, the weight of the uniform component.
    """

    def __init__(self, weight=DEFENSIVE_WEIGHT):
        super().__init__()
        self.weight = weight

    def _pyro_sample(self, msg):
        if msg["is_observed"] or msg["value"] is not None:
            return
        fn = msg["fn"]
        base, num_event = fn, 0
        while isinstance(base, torch.distributions.Independent):  # masks are left alone
            base, num_event = base.base_dist, num_event + base.reinterpreted_batch_ndims
        if not isinstance(base, _MIXABLE):
            return
        mixed = _mixed(base, self.weight)
        msg["fn"] = mixed.to_event(num_event) if num_event else mixed
        msg["infer"] = {**msg["infer"], GUIDE_FN: fn}


def defensive_discrete(fn, weight=DEFENSIVE_WEIGHT):
    """``fn`` (a guide) with its discrete choices mixed as :class:`DefensiveDiscreteMessenger`
    does."""
    return DefensiveDiscreteMessenger(weight)(fn)
