"""MPTLoss logs what Trace_ELBO logs on a plain SVI step: no ``Guessed max_plate_nesting``
line (Pyro's ``pyro`` logger prints INFO records to stderr), while it still guesses the
nesting itself."""

import contextlib
import logging

import pyro
import pyro.optim
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_mpt import MPTLoss
from pyro_mpt.models import PPCA


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _elbo_log():
    """The messages of Pyro's ``pyro.infer.elbo`` logger inside the block (that logger's
    parent does not propagate to the root, so pytest's ``caplog`` does not see them)."""
    logger = logging.getLogger("pyro.infer.elbo")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _step(loss):
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    ppca = PPCA(6, 2)
    svi = SVI(ppca.model, AutoNormal(ppca.model), pyro.optim.Adam({"lr": 0.01}), loss)
    with _elbo_log() as messages:
        svi.step(torch.randn(20, 6))
    return [m for m in messages if "max_plate_nesting" in m]


def test_mpt_loss_logs_no_plate_nesting_guess_like_trace_elbo():
    assert _step(Trace_ELBO()) == []
    loss = MPTLoss(conditionals="exact", guide_loss="elbo")
    assert _step(loss) == []
    # The guess itself still happens: the data plate is one level deep.
    assert loss.max_plate_nesting == 1
    assert not logging.getLogger("pyro.infer.elbo").disabled


def test_the_handler_sees_pyros_guess_when_called_directly():
    ppca = PPCA(6, 2)
    with _elbo_log() as messages:
        Trace_ELBO()._guess_max_plate_nesting(ppca.model, lambda x: None, (torch.randn(4, 6),), {})
    assert any("Guessed max_plate_nesting = 1" in m for m in messages)
