"""Checks of a model's trace that ``Trace_ELBO`` makes too, or that integrating the local
latents out needs: every batch dim in a plate, latents masked and scaled like their
observation."""

import torch

__all__ = ["check_latent_effects", "check_plates_cover_batch", "scale_mismatch"]


def check_plates_cover_batch(site):
    """Raises, as ``Trace_ELBO``'s shape check does, when a batch dim of the site's
    distribution is in no plate: its log-probability would be summed over it silently."""
    plated = {f.dim for f in site["cond_indep_stack"] if f.vectorized}
    for i, size in enumerate(site["fn"].batch_shape):
        dim = i - len(site["fn"].batch_shape)
        if size > 1 and dim not in plated:
            raise ValueError(
                f"At site {site['name']!r}, invalid log_prob shape: the distribution has batch "
                f"shape {tuple(site['fn'].batch_shape)} and dim {dim} (size {size}) is in no "
                f"plate. Enclose the site in a pyro.plate over that dim, or declare the dims "
                f"as one event with .to_event(...)."
            )


def _per_observation(tensor, site, num_batch, batch_shape, reduce):
    """A tensor over a latent site's batch shape (its mask or scale) as one value per
    observation, ``batch_shape``: ``reduce`` (``all`` or ``amax``) over its inner dims."""
    batch = site["fn"].batch_shape
    tensor = torch.as_tensor(tensor).expand(batch)
    inner = tuple(range(num_batch, len(batch)))
    if inner:
        tensor = reduce(tensor.flatten(num_batch), -1)
    return torch.broadcast_to(tensor, batch_shape)


def check_latent_effects(trace, latents, observed, scale):
    """Latents must count wherever their observation does and be scaled like it."""
    present = None if observed.entries is None else observed.entries.any(-1)
    for latent in latents:
        site = trace.nodes[latent.name]
        args = (site, latent.num_batch_dims, observed.batch_shape)
        if site["mask"] is not None and site["mask"] is not True:
            mask = _per_observation(site["mask"], *args, lambda t, d: t.all(d))
            needed = torch.ones_like(mask) if present is None else present
            if bool((needed & ~mask).any()):
                raise ValueError(
                    f"Latent site {latent.name!r} is masked out for observations whose "
                    f"observed site {observed.name!r} counts. MPTLoss integrates each "
                    f"observation's latents out; mask the observation too (put the "
                    f"poutine.mask around both), or mark its missing entries with obs_mask."
                )
        latent_scale = site["scale"]
        if torch.is_tensor(latent_scale) or torch.is_tensor(scale):
            latent_scale = _per_observation(latent_scale, *args, lambda t, d: t.amax(d))
            same = bool((torch.as_tensor(scale) == latent_scale).all())
        else:
            same = float(latent_scale) == scale
        if not same:
            raise scale_mismatch(latent.name, observed.name)


def scale_mismatch(latent_name, observed_name):
    """The error for a latent scaled unlike its observation (a tempered likelihood)."""
    return ValueError(
        f"Latent site {latent_name!r} and observed site {observed_name!r} have different "
        f"scales (poutine.scale on one of them only): MPTLoss estimates log p(x) with the "
        f"latents integrated out, which a tempered likelihood does not have. Scale the whole "
        f"model (both sites) or neither."
    )
