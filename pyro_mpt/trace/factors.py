"""The ``pyro.factor`` terms of a model: those that do not depend on the local latents are
added to the loss as ``Trace_ELBO`` adds them; one that does changes the latents' prior,
which no strategy integrates, and is refused."""

import math

import torch

__all__ = ["check_factors", "factor_log_prob"]


def check_factors(structure, trace, what):
    """Raises ``ValueError`` if a ``pyro.factor`` of a run with extra leading dims (points
    or samples) varies along them: it depends on the local latents, so it is part of their
    prior, which ``what`` cannot integrate."""
    nesting = structure.max_plate_nesting
    for name in structure.factor_names:
        log_factor = trace.nodes[name]["fn"].log_factor.detach()
        num_lead = max(0, log_factor.dim() - nesting)
        flat = log_factor.reshape((-1,) + log_factor.shape[num_lead:])
        tol = 10 * math.sqrt(torch.finfo(flat.dtype).eps) * (1 + flat.abs().amax())
        if bool(((flat - flat[:1]).abs() > tol).any()):
            raise ValueError(
                f"pyro.factor site {name!r} depends on the local latents: it changes their "
                f"prior, which {what} cannot integrate. Write the latent's prior as its "
                f"distribution, or keep the factor to terms that involve parameters and data "
                f"only (those are added to the loss as Trace_ELBO adds them)."
            )


def factor_log_prob(structure, trace=None):
    """The sum of the model's ``pyro.factor`` terms in ``trace`` (by default the structure's
    own), scaled and masked as ``Trace_ELBO`` scores them: a scalar, 0 when there is none.
    In a run with leading dims of points or samples, the terms (which
    :func:`check_factors` found constant along them) are read at the first."""
    trace = structure.trace if trace is None else trace
    nesting = structure.max_plate_nesting
    total = 0.0
    for name in structure.factor_names:
        site = trace.nodes[name]
        log_prob = site["fn"].log_prob(site["value"])
        if site["mask"] is not None and site["mask"] is not True:
            log_prob = log_prob * torch.as_tensor(site["mask"]).to(log_prob.dtype)
        log_prob = site["scale"] * log_prob
        num_lead = max(0, log_prob.dim() - nesting)
        total = total + log_prob.reshape((-1,) + log_prob.shape[num_lead:])[0].sum()
    return total
