"""Refusing plates that subsample, for the functions that return one value per observation
of the data they are given (:func:`~pyro_mpt.log_marginal`, :func:`~pyro_mpt.mpt_curve`):
under ``subsample_size`` a run of the model scores a random subset of the data, whose
values would pass for the data's."""

import contextlib

from pyro.poutine.messenger import Messenger
from pyro.poutine.util import site_is_subsample

__all__ = ["SubsampledPlates", "refusing_subsampled_plates"]


class SubsampledPlates(Messenger):
    """Records, while active, every plate that subsamples: ``{name: (size, subsample)}``
    in :attr:`found`, the plate's size and how many of its members a run kept."""

    def __init__(self):
        super().__init__()
        self.found = {}

    def _pyro_post_sample(self, msg):
        if not site_is_subsample(msg):
            return
        size, indices = msg["fn"].size, msg["value"]
        kept = len(indices) if indices is not None else size
        if 0 <= kept < size:
            self.found[msg["name"]] = (size, kept)


@contextlib.contextmanager
def refusing_subsampled_plates(what):
    """Raises ``ValueError`` after the block if a model run in it subsampled a plate:
    ``what`` (what the caller returns, in words, e.g. ``"log_marginal returns one value per
    observation"``) would be that of a random subset of the data."""
    plates = SubsampledPlates()
    with plates:
        yield
    if plates.found:
        name, (size, kept) = next(iter(plates.found.items()))
        raise ValueError(
            f"{what} of the data, but plate {name!r} subsamples {kept} of its {size} "
            f"members on each run of the model: the result would be that of a random subset, "
            f"in no order you are given. Evaluate with the "
            f"whole plate (subsample_size=None, e.g. through an argument of the model), or "
            f"pass the rows to evaluate as the data."
        )
