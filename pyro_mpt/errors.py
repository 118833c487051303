"""Exceptions raised by pyro_mpt."""

__all__ = ["NotApplicableError"]


class NotApplicableError(ValueError):
    """A conditional strategy does not apply to the model it was given.

    ``conditionals="auto"`` catches it to try the next strategy; any other ``ValueError`` is
    a problem with the model or its data and propagates at once.
    """
