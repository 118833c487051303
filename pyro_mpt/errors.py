"""Exceptions and warnings raised by pyro_mpt, the argument check every constructor
shares, and where a warning points."""

import numbers
import os
import sys

import pyro
import torch

__all__ = [
    "ImportanceAccuracyWarning",
    "NotApplicableError",
    "QuadratureAccuracyWarning",
    "StaleStructureError",
    "UnmeasuredAccuracyWarning",
    "check_positive_int",
    "joint_likelihood_error",
    "unsupported_prior_error",
    "user_stacklevel",
    "without_trace_shapes",
]


class NotApplicableError(ValueError):
    """A conditional strategy does not apply to the model it was given.

    ``conditionals="auto"`` catches it to try the next strategy; any other ``ValueError`` is
    a problem with the model or its data and propagates at once.
    """


class ImportanceAccuracyWarning(UserWarning):
    """Importance-sampled conditionals or log-marginals whose weights say they cannot be
    trusted (Pareto k-hat above 0.7, or too few effective samples).

    The message states the measured figures and the fix; the figures are also readable from
    code (``MPTLoss.diagnostics``, ``SelfPredictive.diagnostics``).
    """


class QuadratureAccuracyWarning(UserWarning):
    """A quadrature rule that refining changes by more than ``auto``'s accuracy threshold
    (:data:`~pyro_mpt.conditionals.auto.ACCURACY_TOL` nats of ``log p(x)`` per observation)
    on the data of a training step: its conditionals are about that far off. Rules sharp
    enough for an untrained model may not be for a trained one, whose posterior is narrower.

    The message states the measured figure and the fix; the figure is also readable from code
    (``MPTLoss.rule_check``).

    Also given, with their number, for conditionals that the floors of the fast sums kept
    off the CPU (quadrature's too high, those of importance sampling over shared draws too
    low, by up to tens of nats): more of them lay near the floors in one call than
    :data:`~pyro_mpt.ops.floored_exp.MAX_EXACT_OFF_CPU`, which are computed again
    (:ref:`theory-floors`).
    """


class UnmeasuredAccuracyWarning(UserWarning):
    """Conditionals that approximate ``p(x_j | x_R)`` by a rule whose error nothing measures
    (:class:`~pyro_mpt.conditionals.EncodeDecode`): their figures may be far off with no
    other word. Given once per strategy object, when it is first used; where a call's own
    figure passes its limit, or one draw leaves the call with none (at the 1st, 10th,
    100th, ... such call of an ``MPTLoss``, once per call of a function); and by ``MPTLoss``
    with the measured figure when, on a step where it checks them (the 1st, 2nd, 16th, every
    64th), their estimate lies below an importance-sampling lower bound of ``log p(x)``. Also
    given, for importance and encode-decode conditionals alike, where that check cannot
    measure some observations: its own estimate rests wholly on one draw of the guide there
    (:func:`~pyro_mpt.conditionals.reference_check.mpt_gap_to_reference`)."""


class StaleStructureError(Exception):
    """A model read once and reused for later calls of the same argument shapes has changed
    in a way the shapes do not show (its observed site gained a mask). Raised by a run of
    the model and caught by ``MPTLoss`` and the package's functions, which then read the
    model afresh: a user sees it only where nothing could."""


def check_positive_int(name, value, hint=None):
    """``value`` as an ``int`` after checking that it is a positive integer.

    :param str name: the argument's name, for the message.
    :param value: the argument.
    :param str hint: a sentence appended to the message of a value below 1, e.g. what the
        argument means.
    :raises TypeError: if it is not an integer (``True`` and ``False`` are not counts).
    :raises ValueError: if it is below 1.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be a positive integer, got {value!r} of type {type(value).__name__}."
        )
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}." + (f" {hint}" if hint else ""))
    return int(value)


def joint_likelihood_error(name, base, what):
    """The :class:`NotApplicableError` for an observed site ``name`` whose likelihood
    ``base`` (wrappers stripped) has an event of its own instead of one distribution per
    feature, for the strategy ``what`` (its words: ``"quadrature"``, ...)."""
    hint = "e.g. Bernoulli(...).to_event(1)"
    if isinstance(base, torch.distributions.OneHotCategorical):
        hint = (
            "a OneHotCategorical per feature holds each feature's categories as an event of "
            "its own: observe integer categories under Categorical(logits=...).to_event(1) "
            "instead, the same model with one distribution per feature"
        )
    return NotApplicableError(
        f"Observed site {name!r} has a {type(base).__name__} likelihood that does not "
        f"factorise over features; {what} needs one distribution per feature ({hint})."
    )


def unsupported_prior_error(name, fn):
    """The :class:`NotApplicableError` for a latent whose prior cannot be written as a map of
    standard normal noise, which quadrature and exact conditionals integrate over.

    :param str name: the latent site's name.
    :param fn: its prior as the model gives it, named by its own class (``HalfCauchy``, not
        the ``Cauchy`` it transforms), with ``.to_event`` and ``.mask`` wrappers stripped.
    """
    while isinstance(fn, torch.distributions.Independent) or hasattr(fn, "_mask"):
        fn = fn.base_dist
    inner = getattr(fn, "base_dist", None)
    of = f" (a transform of {type(inner).__name__})" if inner is not None else ""
    fix = (
        "write it as a Categorical or Bernoulli site of finitely many values, which "
        "quadrature sums over every value."
        if fn.support.is_discrete
        else "reparameterise the site as a transform of a Normal."
    )
    return NotApplicableError(
        f"Latent site {name!r} has a {type(fn).__name__} prior{of}; integrating the latents "
        f"numerically or exactly needs Normal, MultivariateNormal or LogNormal-type "
        f"(transformed normal) priors, or discrete ones of finitely many values with scalar "
        f"events. Use conditionals='importance' with a guide that samples "
        f"{name!r}, or {fix}"
    )


def without_trace_shapes(message):
    """``message`` without the table of trace shapes that Pyro appends to an error raised
    inside a traced model run: the package's own errors say what is wrong in words."""
    return message.split("\nTrace Shapes:")[0].rstrip()


#: Where pyro_mpt's, Pyro's and torch's own source files lie (torch's: the ``nn.Module``
#: call of the module form of a loss, ``MPTLoss()(model, guide)``, and the ``no_grad``
#: wrapper of the package's functions): frames there are not the user's.
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(module.__file__)) + os.sep
    for module in (sys.modules[__name__], pyro, torch)
)


def user_stacklevel():
    """The ``stacklevel`` that makes a ``warnings.warn`` in the calling function point at
    the first frame outside pyro_mpt, Pyro and torch: the user's line, however many of their
    functions (``SVI.step``, ``SVI.evaluate_loss``, a direct call) lie between."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level
