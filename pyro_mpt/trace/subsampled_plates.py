"""Refusing plates that subsample, for the functions that return figures or draws of every
observation of the data they are given (:func:`~pyro_mpt.log_marginal`,
:func:`~pyro_mpt.mpt_curve`, :func:`~pyro_mpt.impute`, :func:`~pyro_mpt.gibbs`): under
``subsample_size`` a run of the model sees a random subset of the data, whose results would
pass for the data's."""

import contextlib

from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample

__all__ = ["SubsampledPlates", "refusing_subsampled_plates"]


class SubsampledPlates(Messenger):
    """Records, while active, every plate that subsamples: ``{name: (size, kept)}`` in
    :attr:`found`, the plate's size and how many of its members a run kept.

    :param str what: what the caller returns, in words (``"log_marginal returns one value
        per observation"``), for :meth:`refuse`'s message.
    """

    def __init__(self, what):
        super().__init__()
        self.what = what
        self.found = {}

    def _pyro_post_sample(self, msg):
        if not site_is_subsample(msg):
            return
        size, indices = msg["fn"].size, msg["value"]
        kept = len(indices) if indices is not None else size
        if 0 <= kept < size:
            self.found[msg["name"]] = (size, kept)

    def refuse(self):
        """Raises ``ValueError`` if a run so far subsampled a plate."""
        if not self.found:
            return
        name, (size, kept) = next(iter(self.found.items()))
        raise ValueError(
            f"{self.what} of the data, but plate {name!r} subsamples {kept} of its {size} "
            f"members on each run of the model: the result would be that of a random subset, "
            f"in no order you are given. Evaluate with the whole plate (subsample_size=None, "
            f"e.g. through an argument of the model), or pass the rows to evaluate as the "
            f"data."
        )


@contextlib.contextmanager
def refusing_subsampled_plates(what):
    """Watches the model runs in the block (yields the :class:`SubsampledPlates`, whose
    :meth:`~SubsampledPlates.refuse` a caller may call as soon as the model has run) and
    refuses a plate that subsampled when the block ends."""
    plates = SubsampledPlates(what)
    with plates:
        yield plates
    plates.refuse()
