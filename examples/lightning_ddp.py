"""Data-parallel training of a Pyro model by masked pre-training, with PyTorch Lightning.

This is the pattern of Pyro's own Lightning example (``examples/svi_lightning.py`` in Pyro)
with one change, the loss: ``loss_fn = MPTLoss()(model, guide)`` where Pyro has
``Trace_ELBO()(model, guide)``. Everything else is as there: one ``pyro.set_rng_seed`` for
every process, module-local parameters, an ``AutoNormal`` guide, a plain ``DataLoader`` that
Lightning shards over the processes, one mini-batch through the loss to create the guide's
parameters before the optimiser is built, and a ``LightningModule`` that returns
``loss_fn(*batch)``. ``MPTLoss`` draws different masks on every process by itself, and gives
the guide's parameters, which exact conditionals do not use, a zero gradient so that
``DistributedDataParallel`` finds every parameter used. See ``docs/scaling.rst``.

The model is probabilistic PCA rather than Pyro's regression: MPT integrates out a latent
per observation, and the regression has global latents only.

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
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroParam

from pyro_mpt import MPTLoss

try:
    import lightning.pytorch as pl
except ImportError:  # main() says what to install
    pl = None

INSTALL_HINT = 'pip install "pyro-mpt[lightning]"'


class PPCA(PyroModule):
    """Probabilistic PCA, ``z_n ~ N(0, I_K)``, ``x_n | z_n ~ N(W z_n + mu, sigma^2 I_D)``.

    The data plate has the size of the whole data set and takes the mini-batch it is given,
    which the data loader of each process has cut from that process's shard: a plate that
    subsampled by itself would draw the same indices on every process. ``MPTLoss`` then
    scales each batch's estimate by ``num_data / len(x)``, as ``Trace_ELBO`` does.
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


def step_seed(seed, step):
    """The seed of every process at optimiser step ``step`` under ``--reseed-each-step``."""
    return seed + 1 + step


def make_data(args):
    """Synthetic data from a PPCA with ``K = latent_dim`` and noise scale 0.5, in the default
    dtype, from a generator of its own (the global one is left to the model and the masks)."""
    generator = torch.Generator().manual_seed(args.seed)
    weight = torch.randn(args.num_features, args.latent_dim, generator=generator)
    z = torch.randn(args.num_data, args.latent_dim, generator=generator)
    noise = torch.randn(args.num_data, args.num_features, generator=generator)
    return z @ weight.T + 0.5 * noise


def exact_log_marginal(model, data):
    """The exact ``log p(x)`` per observation of the PPCA ``model``, averaged over ``data``:
    ``x ~ N(mu, W W^T + sigma^2 I)`` once ``z`` is integrated out."""
    with torch.no_grad():
        weight, loc, scale = model.weight, model.loc, model.noise_scale
        cov = weight @ weight.T + scale**2 * torch.eye(len(loc), dtype=weight.dtype)
        return torch.distributions.MultivariateNormal(loc, cov).log_prob(data).mean().item()


def max_log_marginal(data, latent_dim):
    """The largest ``log p(x)`` per observation that any PPCA with ``latent_dim`` latents
    reaches on ``data``: the closed-form maximum-likelihood PPCA of Tipping and Bishop
    (1999), whose noise variance is the mean of the discarded eigenvalues of the sample
    covariance. The reference that training by ``MPTLoss`` climbs towards."""
    centered = data - data.mean(0)
    eigvals, eigvecs = torch.linalg.eigh(centered.T @ centered / len(data))
    eigvals, eigvecs = eigvals.flip(0), eigvecs.flip(1)
    noise_var = eigvals[latent_dim:].mean()
    weight = eigvecs[:, :latent_dim] * (eigvals[:latent_dim] - noise_var).sqrt()
    cov = weight @ weight.T + noise_var * torch.eye(data.shape[-1], dtype=data.dtype)
    return torch.distributions.MultivariateNormal(data.mean(0), cov).log_prob(data).mean().item()


def make_model(args):
    """The model and its ``AutoNormal`` guide, after ``pyro.set_rng_seed(args.seed)``: the
    same on every process (DDP broadcasts rank 0's parameters in any case). The guide's
    parameters are created by the first call of the loss."""
    pyro.set_rng_seed(args.seed)
    model = PPCA(args.num_data, args.num_features, args.latent_dim)
    return model, AutoNormal(model)


if pl is not None:

    class PyroLightningModule(pl.LightningModule):
        """A ``LightningModule`` whose loss is a Pyro objective turned into a module.

        :param loss_fn: ``MPTLoss()(model, guide)`` (or any ``ELBO()(model, guide)``).
        :param float lr: Adam's learning rate.
        """

        def __init__(self, loss_fn, lr):
            super().__init__()
            self.loss_fn = loss_fn
            self.model = loss_fn.model
            self.guide = loss_fn.guide
            self.lr = lr
            self.predictive = pyro.infer.Predictive(self.model, guide=self.guide, num_samples=1)

        def forward(self, *args):
            return self.predictive(*args)

        def training_step(self, batch, batch_idx):
            # Minus the estimate of log p of the whole data set from this process's batch;
            # DDP averages the processes' gradients.
            loss = self.loss_fn(*batch)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.loss_fn.parameters(), lr=self.lr)

    class RecordingLightningModule(PyroLightningModule):
        """:class:`PyroLightningModule` that can reseed every process alike at each step and
        saves each process's first step (its batch, loss, gradient and parameters) for
        ``tests/test_lightning_ddp.py``.

        :param args: the command-line options (``reseed_each_step``, ``dump``, ``optimizer``).
        """

        def __init__(self, loss_fn, args):
            super().__init__(loss_fn, args.learning_rate)
            self.args = args
            self._dump = {}

        def on_train_batch_start(self, batch, batch_idx):
            if self.args.reseed_each_step:
                # The same seed on every process, as one pyro.set_rng_seed gives.
                pyro.set_rng_seed(step_seed(self.args.seed, self.global_step))

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if self.global_step == 0:
                self._dump.update(x=batch[0].detach().clone(), loss=loss.detach().clone())
            return loss

        def on_before_optimizer_step(self, optimizer):
            # The gradients here are already averaged over the processes.
            if self.global_step == 0:
                self._dump["params_before"] = _named(self.loss_fn.named_parameters())
                self._dump["grads"] = {
                    name: None if p.grad is None else p.grad.detach().clone()
                    for name, p in self.loss_fn.named_parameters()
                }

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.global_step == 1:  # the first optimiser step has been taken
                self._dump["params_after"] = _named(self.loss_fn.named_parameters())

        def on_train_end(self):
            if self.args.dump is not None:
                self._dump.update(world_size=self.trainer.world_size, steps=self.global_step)
                os.makedirs(self.args.dump, exist_ok=True)
                path = os.path.join(self.args.dump, f"rank{self.global_rank}.pt")
                torch.save(self._dump, path)

        def configure_optimizers(self):
            if self.args.optimizer == "sgd":
                return torch.optim.SGD(self.loss_fn.parameters(), lr=self.lr)
            return super().configure_optimizers()


def _named(named_parameters):
    return {name: p.detach().clone() for name, p in named_parameters}


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-data", type=int, default=4096)
    parser.add_argument("--num-features", type=int, default=20)
    parser.add_argument("--latent-dim", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256, help="per process")
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-epochs", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=-1)
    # For tests/test_lightning_ddp.py.
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument(
        "--reseed-each-step",
        action="store_true",
        help="seed every process alike afresh at every step, so that a test can draw the "
        "masks again outside the run",
    )
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
    recording = args.dump is not None or args.reseed_each_step or args.optimizer != "adam"
    if recording:
        plan = RecordingLightningModule(loss_fn, args)
    else:
        plan = PyroLightningModule(loss_fn, args.learning_rate)

    dataset = torch.utils.data.TensorDataset(data)
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size)
    # The guide's parameters are created on its first run: one mini-batch through the loss
    # before configure_optimizers collects the parameters.
    loss_fn(*dataset[: args.batch_size])
    # Where training starts, for the figures printed at the end; the masks of this one
    # evaluation leave the random stream of training as it was.
    with torch.no_grad(), torch.random.fork_rng():
        start_loss = (loss_fn(data) / args.num_data).item()
    start_lml = exact_log_marginal(model, data)

    devices = int(args.devices) if args.devices.isdigit() else args.devices
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        strategy=args.strategy,
        devices=devices,
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(plan, train_dataloaders=dataloader)
    if trainer.global_rank == 0:
        with torch.no_grad():
            loss = (loss_fn(data) / args.num_data).item()
        # The MPT loss is a one-mask estimate of minus log p(x), so it is noisy; the exact
        # log p(x) of the same model and the best any PPCA reaches judge it.
        print(
            f"MPT loss on the whole data set: {start_loss:.4f} before training, "
            f"{loss:.4f} after (nats per observation)"
        )
        print(
            f"exact log p(x) per observation: {start_lml:.4f} before training, "
            f"{exact_log_marginal(model, data):.4f} after; the maximum-likelihood PPCA with "
            f"K={args.latent_dim} reaches {max_log_marginal(data, args.latent_dim):.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
