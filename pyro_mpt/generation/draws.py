"""Draws of hidden features through the interface of the prepared conditionals.

Every strategy's :class:`~pyro_mpt.conditionals.SelfPredictive` draws its own features
(:meth:`~pyro_mpt.conditionals.SelfPredictive.sample`); this module only checks what comes
back, so that a strategy written outside the package serves :func:`~pyro_mpt.impute` and
:func:`~pyro_mpt.gibbs` as the built-in ones do.
"""

__all__ = ["draw_hidden"]


def draw_hidden(prepared, hidden, num_samples, joint=True):
    """Draws the hidden features of every observation, jointly from ``p(x_S | x_R)``
    (``joint=True``) or each hidden feature from its own ``p(x_j | x_R)``; the other
    features keep their given values.

    :param prepared: the :class:`~pyro_mpt.conditionals.SelfPredictive` of the batch.
    :param torch.Tensor hidden: booleans ``batch + (D,)``, ``True`` at features to draw.
    :param int num_samples: draws per observation.
    :param bool joint: draw the hidden features jointly, or each from its own conditional.
    :returns: a tensor ``(num_samples,) + batch + (D,)`` in the dtype of the data the model
        observed.
    :raises NotImplementedError: for conditionals that offer no draws.
    :raises ValueError: if the draws do not have that shape.
    """
    draws = prepared.sample(hidden, num_samples, joint=joint)
    expected = (num_samples,) + tuple(hidden.shape)
    if tuple(draws.shape) != expected:
        raise ValueError(
            f"{type(prepared).__name__}.sample(hidden, num_samples={num_samples}, "
            f"joint={joint}) returned draws of shape {tuple(draws.shape)}; it must return "
            f"(num_samples,) + hidden.shape = {expected}, the hidden features drawn and the "
            f"others given (SelfPredictive.keep_given)."
        )
    return draws
