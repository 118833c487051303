"""One process of a two-process ``MPTLoss`` run, launched by
``tests/test_distributed_masks.py`` (CPU, gloo; ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` in the environment).

Every process seeds Pyro alike, as Pyro's Lightning example does, then evaluates
``MPTLoss().estimate`` on its own shard of a fixed data set at fixed PPCA parameters for a
number of steps, and saves the masks that ``MPTLoss`` drew and its estimates to
``<out>/rank<r>.pt``.

Usage: ``python tests/_ddp_masks_script.py OUT SEED STEPS``.
"""

import os
import sys

import pyro
import pyro.distributions as dist
import torch
import torch.distributed
from pyro.nn import PyroModule

import pyro_mpt.loss
from pyro_mpt import MPTLoss

NUM_FEATURES = 6
LATENT_DIM = 2
ROWS_PER_RANK = 8
NOISE_SCALE = 0.7


def ppca_parameters():
    """Fixed PPCA parameters ``(weight, loc)``, the same in every process."""
    generator = torch.Generator().manual_seed(11)
    weight = torch.randn(NUM_FEATURES, LATENT_DIM, generator=generator)
    loc = torch.randn(NUM_FEATURES, generator=generator)
    return weight, loc


def shards(world_size):
    """The data set, ``world_size`` shards of ``ROWS_PER_RANK`` rows, all different."""
    generator = torch.Generator().manual_seed(12)
    x = 2.0 * torch.randn(world_size, ROWS_PER_RANK, NUM_FEATURES, generator=generator)
    return list(x)


class FixedPPCA(PyroModule):
    """PPCA at fixed parameters: ``p(x) = N(loc, W W^T + sigma^2 I)`` in closed form."""

    def __init__(self, weight, loc):
        super().__init__()
        self.weight, self.loc = weight, loc

    def forward(self, x):
        with pyro.plate("data", len(x)):
            z = pyro.sample("z", dist.Normal(x.new_zeros(LATENT_DIM), 1.0).to_event(1))
            mean = z @ self.weight.T + self.loc
            pyro.sample("x", dist.Normal(mean, NOISE_SCALE).to_event(1), obs=x)


def run(seed, steps, x):
    """The masks ``MPTLoss`` draws on ``x`` at each of ``steps`` steps after
    ``pyro.set_rng_seed(seed)``, and its estimates: tensors ``(steps, n, D)`` and ``(steps, n)``.
    """
    drawn = []
    sample_masks = pyro_mpt.loss.sample_masks

    def recording(*args, **kwargs):
        masks, sizes = sample_masks(*args, **kwargs)
        drawn.append(masks.squeeze(0))
        return masks, sizes

    pyro_mpt.loss.sample_masks = recording
    try:
        pyro.set_rng_seed(seed)
        model = FixedPPCA(*ppca_parameters())
        loss = MPTLoss()
        estimates = torch.stack([loss.estimate(model, None, x) for _ in range(steps)])
    finally:
        pyro_mpt.loss.sample_masks = sample_masks
    return torch.stack(drawn), estimates


def main(out, seed, steps):
    torch.set_default_dtype(torch.float64)
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    masks, estimates = run(seed, steps, shards(torch.distributed.get_world_size())[rank])
    torch.save({"masks": masks, "estimates": estimates}, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
