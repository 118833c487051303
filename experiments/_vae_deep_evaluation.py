"""The held-out LML of ``vae-deep`` by a procedure that favours no run's own encoder: a fresh
encoder fitted to each trained, frozen decoder by the IWAE bound (:func:`refit_encoder`),
then the IWAE bound with many samples (:func:`iwae_log_marginal`) and, at latent size 2,
Gauss–Hermite quadrature centred at the fresh encoder (:func:`quadrature_log_marginal`);
:func:`fair_evaluation` runs all three for one trained run."""

import math

import torch
from pyro.infer import RenyiELBO

from experiments import _common as common
from experiments._vae_deep_training import count_warnings, new_vae, own_random_numbers
from pyro_mpt import log_marginal
from pyro_mpt.conditionals import ImportanceSampling, Quadrature

__all__ = ["fair_evaluation", "iwae_log_marginal", "quadrature_log_marginal", "refit_encoder"]

#: Points of the refit curve kept in the record.
_CURVE_POINTS = 10


def _decoder_state(state):
    """The entries of a VAE's ``state_dict`` that belong to the model (decoder and noise
    scale), not to the encoder."""
    return {k: v for k, v in state.items() if not k.startswith("encoder.")}


def refit_encoder(method, cfg, state, x, init_seed, seed):
    """A fresh encoder for a trained decoder: a VAE from the run's initialisation
    (``init_seed``, so the encoder starts where every row's did) with the trained decoder
    ``state`` loaded and frozen, its encoder trained by the IWAE bound
    (``RenyiELBO(alpha=0, num_particles=cfg["refit_samples"])``) for ``cfg["refit_steps"]``
    Adam steps on mini-batches of ``cfg["refit_batch"]`` training images ``x`` drawn with
    ``seed``.

    :returns: ``(vae, curve)``: the VAE (the newest in the param store), and the IWAE bound
        per image over the steps, averaged over ``_CURVE_POINTS`` equal stretches.
    """
    vae = new_vae(method, cfg, init_seed, x)
    vae.load_state_dict(_decoder_state(state), strict=False)
    encoder = list(vae.encoder.parameters())
    trainable = {id(p) for p in encoder}
    for parameter in vae.parameters():  # the decoder and the noise scale stay as trained
        parameter.requires_grad_(id(parameter) in trainable)
    optimizer = torch.optim.Adam(encoder, lr=cfg["refit_lr"])
    loss_fn = RenyiELBO(
        alpha=0, num_particles=cfg["refit_samples"], vectorize_particles=True, max_plate_nesting=1
    )
    values = []
    with own_random_numbers(seed, x.device):
        for _ in range(cfg["refit_steps"]):
            idx = torch.randint(x.shape[0], (cfg["refit_batch"],), device=x.device)
            optimizer.zero_grad()
            values.append(-loss_fn.loss_and_grads(vae.model, vae.guide, x[idx]) / len(idx))
            optimizer.step()
    if not values:
        return vae, []
    stretches = torch.tensor(values).tensor_split(min(_CURVE_POINTS, len(values)))
    return vae, [float(part.mean()) for part in stretches]


def _blocks(total, size):
    """Sizes of consecutive blocks of at most ``size`` that add up to ``total``."""
    return [min(size, total - start) for start in range(0, total, size)]


def iwae_log_marginal(vae, x, num_samples, chunk):
    """The IWAE bound of ``log p(x)`` per observation with ``num_samples`` samples of the
    VAE's guide, ``LSE_s(log p(x, z_s) - log q(z_s | x)) - log S``, shape ``(N,)``.

    The samples come in blocks and the observations in groups, so that one pass holds at
    most ``chunk`` (sample, observation) pairs; the blocks' estimates combine exactly, as
    ``LSE_b(estimate_b + log S_b) - log S``.
    """
    sample_blocks = _blocks(num_samples, min(num_samples, chunk))
    per_pass = max(1, chunk // sample_blocks[0])
    out = []
    with torch.no_grad():
        for part in x.split(per_pass):
            terms = [
                log_marginal(
                    vae.model, part, conditionals=ImportanceSampling(size), guide=vae.guide
                )
                + math.log(size)
                for size in sample_blocks
            ]
            out.append(torch.logsumexp(torch.stack(terms), 0) - math.log(num_samples))
    return torch.cat(out)


def quadrature_log_marginal(vae, x, num_points, chunk):
    """``log p(x)`` per observation by a ``num_points x num_points`` Gauss–Hermite rule whose
    nodes are centred and scaled at the VAE's guide for each observation
    (``Quadrature(center="guide")``; latent size 2 only), in groups of observations of at
    most ``chunk`` (node, observation) pairs."""
    rule = Quadrature(num_points=num_points, max_latent_dim=2, center="guide")
    per_pass = max(1, chunk // num_points**2)
    with torch.no_grad():
        return torch.cat(
            [
                log_marginal(vae.model, part, conditionals=rule, guide=vae.guide)
                for part in x.split(per_pass)
            ]
        )


def fair_evaluation(method, cfg, state, x, x_test, seeds):
    """The held-out LML of one trained run with a fresh encoder (:func:`refit_encoder` on
    the training images ``x``): its IWAE bound with ``cfg["final_samples"]`` samples on the
    held-out images ``x_test`` and, at latent size 2, its quadrature value with
    ``cfg["quadrature_points"]`` nodes per dimension; means per image.

    :param dict seeds: ``init`` (the run's initialisation), ``refit`` and ``evaluation``.
    :returns: a dict: ``test_log_marginal`` (the IWAE bound), ``quadrature_log_marginal``
        (or ``None``), ``refit_curve``, ``importance_warnings`` and ``seconds``.
    """
    counts = {}
    with (
        common.Stopwatch() as clock,
        count_warnings("ImportanceAccuracyWarning", counts, "evaluation"),
    ):
        vae, curve = refit_encoder(method, cfg, state, x, seeds["init"], seeds["refit"])
        with own_random_numbers(seeds["evaluation"], x.device):
            iwae = iwae_log_marginal(vae, x_test, cfg["final_samples"], cfg["chunk"])
        quadrature = None
        if method["latent_dim"] == 2:
            values = quadrature_log_marginal(vae, x_test, cfg["quadrature_points"], cfg["chunk"])
            quadrature = float(values.mean())
    return dict(
        test_log_marginal=float(iwae.mean()),
        quadrature_log_marginal=quadrature,
        refit_curve=curve,
        importance_warnings=counts.get("evaluation", 0),
        seconds=clock.seconds,
    )
