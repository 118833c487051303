"""Data-parallel training of a Pyro model by masked pre-training, with PyTorch Lightning.

The model is an ordinary :class:`~pyro.nn.PyroModule` with no reference to Lightning.
``MPTLoss()(model, guide)`` turns the MPT objective into a :class:`torch.nn.Module`, which a
``LightningModule`` calls as its loss, and Lightning's DDP strategy averages the gradients
of the processes. Each process reads its own shard of the data through a
:class:`~torch.utils.data.DistributedSampler` and draws its own masks: its random number
generator is seeded with ``seed + rank``. See ``docs/scaling.rst``.

Two processes on the CPU (gloo backend)::

    python examples/lightning_ddp.py --accelerator cpu --devices 2 --strategy ddp

Needs ``pip install "pyro-mpt[lightning]"``.
"""

import argparse
import os
import sys

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.nn import PyroModule, PyroParam

from pyro_mpt import MPTLoss

try:
    import lightning.pytorch as pl
except ImportError:  # main() says what to install
    pl = None

INSTALL_HINT = 'pip install "pyro-mpt[lightning]"'


class PPCA(PyroModule):
    """Probabilistic PCA, ``z_n ~ N(0, I_K)``, ``x_n | z_n ~ N(W z_n + mu, sigma^2 I_D)``.

    Like Pyro's own Lightning example, the data plate has the size of the whole data set and
    takes mini-batches that the data loader has already cut: a plate that subsampled by
    itself would draw the same indices on every process. ``MPTLoss`` then scales each
    batch's estimate by ``num_data / len(x)``, as ``Trace_ELBO`` does.
    """

    def __init__(self, num_data, num_features, latent_dim):
        super().__init__()
        self.num_data = num_data
        self.latent_dim = latent_dim
        self.weight = PyroParam(0.1 * torch.randn(num_features, latent_dim))
        self.loc = PyroParam(torch.zeros(num_features))
        self.noise_scale = PyroParam(torch.tensor(1.0), constraint=constraints.positive)

    def forward(self, x):
        with pyro.plate("data", self.num_data, subsample_size=len(x)):
            z = pyro.sample("z", dist.Normal(x.new_zeros(self.latent_dim), 1.0).to_event(1))
            loc = z @ self.weight.T + self.loc
            pyro.sample("x", dist.Normal(loc, self.noise_scale).to_event(1), obs=x)


class NoGuide(PyroModule):
    """``MPTLoss`` integrates the linear-Gaussian latent out exactly and never runs a guide;
    ``MPTLoss()(model, guide)`` still takes one."""

    def forward(self, x):
        pass


def step_seed(seed, rank, step, world_size):
    """The seed of process ``rank`` at optimiser step ``step`` under ``--reseed-each-step``:
    distinct for every pair ``(rank, step)``."""
    return seed + rank + world_size * step


def make_data(args):
    """Synthetic data from a PPCA with ``K = latent_dim`` and noise scale 0.5, in the
    default dtype; the same on every process, since each one runs this script with the same
    seed."""
    generator = torch.Generator().manual_seed(args.seed)
    weight = torch.randn(args.num_features, args.latent_dim, generator=generator)
    z = torch.randn(args.num_data, args.latent_dim, generator=generator)
    noise = torch.randn(args.num_data, args.num_features, generator=generator)
    return z @ weight.T + 0.5 * noise


def make_model(args):
    """The model and guide in the default dtype, initialised from ``args.seed`` (identical
    on every process; DDP broadcasts rank 0's parameters in any case)."""
    pyro.set_rng_seed(args.seed)
    return PPCA(args.num_data, args.num_features, args.latent_dim), NoGuide()


if pl is not None:

    class MPTLightningModule(pl.LightningModule):
        """A ``LightningModule`` whose loss is ``MPTLoss()(model, guide)``.

        :param loss_fn: the ``ELBOModule`` returned by ``MPTLoss()(model, guide)``.
        :param dataset: the whole training set; each process reads its own shard.
        :param args: the command-line options (seed, batch size, optimiser, ...).
        """

        def __init__(self, loss_fn, dataset, args):
            super().__init__()
            self.loss_fn = loss_fn
            self.dataset = dataset
            self.args = args

        def train_dataloader(self):
            # A shard per process; the plate in the model knows the size of the whole set.
            sampler = torch.utils.data.DistributedSampler(
                self.dataset,
                num_replicas=self.trainer.world_size,
                rank=self.global_rank,
                shuffle=True,
                seed=self.args.seed,
            )
            return torch.utils.data.DataLoader(
                self.dataset, batch_size=self.args.batch_size, sampler=sampler
            )

        def on_fit_start(self):
            # Independent masks on every process: a different seed per rank.
            pyro.set_rng_seed(self.args.seed + self.global_rank)

        def on_train_batch_start(self, batch, batch_idx):
            if self.args.reseed_each_step:
                world_size = self.trainer.world_size
                pyro.set_rng_seed(
                    step_seed(self.args.seed, self.global_rank, self.global_step, world_size)
                )

        def training_step(self, batch, batch_idx):
            (x,) = batch
            # loss_fn(x) is minus an unbiased estimate of log p of the whole data set from
            # this shard; divided by its size, nats per observation. DDP averages the
            # processes' gradients, so the step follows the mean over the global batch.
            loss = self.loss_fn(x) / self.args.num_data
            self.log("train_loss", loss)
            if self.args.dump is not None:
                self._dump = {"x": x.detach().clone(), "loss": loss.detach().clone()}
            return loss

        def on_before_optimizer_step(self, optimizer):
            # The gradients here are already averaged over the processes.
            if self.args.dump is not None and self.global_step == 0:
                self._dump["params_before"] = _named(self.loss_fn.named_parameters())
                self._dump["grads"] = {
                    name: p.grad.detach().clone() for name, p in self.loss_fn.named_parameters()
                }

        def on_train_end(self):
            if self.args.dump is not None:
                self._dump["params_after"] = _named(self.loss_fn.named_parameters())
                self._dump["world_size"] = self.trainer.world_size
                os.makedirs(self.args.dump, exist_ok=True)
                path = os.path.join(self.args.dump, f"rank{self.global_rank}.pt")
                torch.save(self._dump, path)

        def configure_optimizers(self):
            params = self.loss_fn.parameters()
            if self.args.optimizer == "sgd":
                return torch.optim.SGD(params, lr=self.args.learning_rate)
            return torch.optim.Adam(params, lr=self.args.learning_rate)


def _named(named_parameters):
    return {name: p.detach().clone() for name, p in named_parameters}


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-data", type=int, default=4096)
    parser.add_argument("--num-features", type=int, default=20)
    parser.add_argument("--latent-dim", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256, help="per process")
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--reseed-each-step",
        action="store_true",
        help=(
            "seed every process afresh at every step with seed + rank + world_size * step, "
            "so that its masks can be drawn again outside the run (tests)"
        ),
    )
    parser.add_argument("--max-epochs", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--dump", metavar="DIR", help="save each process's first step here")
    # pl.Trainer arguments.
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", default="auto")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if pl is None:
        print(
            f"error: this example needs lightning; install it with: {INSTALL_HINT}", file=sys.stderr
        )
        return 2
    torch.set_default_dtype(getattr(torch, args.dtype))
    pyro.settings.set(module_local_params=True)  # parameters live in the modules, as DDP needs
    data = make_data(args)
    model, guide = make_model(args)
    loss_fn = MPTLoss()(model, guide)
    plan = MPTLightningModule(loss_fn, torch.utils.data.TensorDataset(data), args)
    devices = int(args.devices) if args.devices.isdigit() else args.devices
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        strategy=args.strategy,
        devices=devices,
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        use_distributed_sampler=False,  # train_dataloader builds its own
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(plan)
    if trainer.global_rank == 0:
        with torch.no_grad():
            loss = loss_fn(data) / args.num_data
        print(f"MPT loss on the whole data set: {loss.item():.4f} nats per observation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
