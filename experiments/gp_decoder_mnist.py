"""GP decoders (GP-LVMs) on MNIST: masked-predictive active sets vs the variational
Bayesian GP-LVM vs the exact marginal likelihood.

Data: grey-level MNIST from :func:`pyro_mpt.datasets.load_mnist` (pixels in ``[0, 1]``,
centred by the training mean of each pixel), ``N`` training and ``T`` held-out images. All
models start from the same PCA codes (``Q`` dims, unit variance) and are trained full batch
with Adam, float32:

* ``MPT |R|=128``: :class:`pyro_mpt.models.GPDecoder` with
  ``MPTLoss(rate=1 - 128/N, share_masks=True)`` (the stochastic active set: 128 context
  points predict the other ``N - 128`` in every output dimension);
* ``MPT uniform``: the same decoder with ``MPTLoss(rate="uniform", share_masks=True)``
  (unbiased for the exact LML);
* ``Bayesian GP-LVM``: GPyTorch's ``BayesianGPLVM`` with a ``VariationalLatentVariable``,
  inducing points and ``VariationalELBO``;
* ``exact LML``: the decoder trained on :meth:`GPDecoder.log_marginal` (one ``N x N``
  Cholesky per step).

Metrics: the exact log marginal likelihood of the learned model per image (for the
Bayesian GP-LVM at the means of ``q(X)`` with its learned kernel and noise), and the held-out
log predictive density of masked pixels: half of each test image's pixels are hidden, its
code is fitted to the visible half under the model's own predictive (GP posterior given the
training data, or the variational predictive), and the hidden half is scored (nats per
pixel). Wall time per epoch (one full-batch step) is measured for ``N`` in
``(256, 512, 1024, 2048)``.
"""

import contextlib
import time
import warnings

import gpytorch
import pyro
import torch
from pyro.infer import SVI

from experiments import _common as common
from experiments._experiment import Report
from pyro_mpt import MPTLoss
from pyro_mpt.datasets import load_mnist
from pyro_mpt.models import GPDecoder

__all__ = ["NAME", "METHODS", "run"]

NAME = "gp-decoder"
METHODS = ("MPT |R|=128", "MPT uniform", "Bayesian GP-LVM", "exact LML")


#: The sizes of each preset, one row per preset; the columns are the keys of ``cfg``.
_COLUMNS = "N T Q steps lr context inducing code_steps sizes timing_steps exact_max".split()
_PRESETS = {
    "smoke": (48, 6, 2, 4, 0.05, 16, 8, 3, (32, 64), 1, 64),
    "default": (1000, 100, 5, 100, 0.03, 128, 32, 60, (256, 512, 1024, 2048), 2, 2048),
    "full": (1000, 100, 5, 300, 0.03, 128, 32, 60, (256, 512, 1024, 2048), 2, 2048),
}


def _config(smoke, full):
    return dict(zip(_COLUMNS, _PRESETS["smoke" if smoke else "full" if full else "default"]))


def _pca_codes(y, latent_dim):
    _, _, v = torch.linalg.svd(y, full_matrices=False)
    codes = y @ v[:latent_dim].T
    return codes / codes.std(0)


class _BayesianGPLVM(gpytorch.models.gplvm.BayesianGPLVM):
    def __init__(self, init_codes, num_outputs, num_inducing):
        num_data, latent_dim = init_codes.shape
        inducing = init_codes[torch.randperm(num_data)[:num_inducing]].clone()
        q_u = gpytorch.variational.CholeskyVariationalDistribution(
            num_inducing, batch_shape=torch.Size([num_outputs])
        )
        q_f = gpytorch.variational.VariationalStrategy(self, inducing, q_u)
        prior = gpytorch.priors.NormalPrior(
            torch.zeros_like(init_codes), torch.ones_like(init_codes)
        )
        codes = gpytorch.models.gplvm.VariationalLatentVariable(
            num_data, num_outputs, latent_dim, init_codes.clone(), prior
        )
        super().__init__(codes, q_f)
        self.mean_module = gpytorch.means.ZeroMean()
        self.covar_module = gpytorch.kernels.ScaleKernel(
            gpytorch.kernels.RBFKernel(ard_num_dims=latent_dim)
        )

    def forward(self, x):
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def _make(method, y, cfg, init_codes):
    """``(step, predictive, lml)`` closures for one freshly initialised model."""
    pyro.clear_param_store()
    num_data, num_outputs = y.shape
    if method == "Bayesian GP-LVM":
        model = _BayesianGPLVM(init_codes, num_outputs, min(cfg["inducing"], num_data))
        likelihood = gpytorch.likelihoods.GaussianLikelihood()
        likelihood.noise = 0.1
        elbo = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=num_data)
        params = list(model.parameters()) + list(likelihood.parameters())
        optimizer = torch.optim.Adam(params, lr=cfg["lr"])

        def step():
            optimizer.zero_grad()
            loss = -elbo(model(model.sample_latent_variable()), y.T).sum()
            loss.backward()
            optimizer.step()

        def predictive(codes):
            # train() drops GPyTorch's prediction caches, which hold the previous graph.
            model.train(), model.eval(), likelihood.eval()
            model.requires_grad_(False), likelihood.requires_grad_(False)
            out = likelihood(model(codes))
            return out.mean.T, out.variance.T

        def lml():
            decoder = GPDecoder(
                num_data,
                num_outputs,
                init_codes.shape[1],
                kernel=model.covar_module,
                init_codes=model.X.q_mu.detach(),
                noise_scale=likelihood.noise.item() ** 0.5,
            )
            with _frozen_parameters_allowed():
                return decoder.log_marginal(y).item()

        return step, predictive, lml
    decoder = GPDecoder(
        num_data, num_outputs, init_codes.shape[1], init_codes=init_codes, noise_scale=0.3
    )
    if method == "exact LML":

        def loss(model, guide, y):
            return -decoder.log_marginal(y)
    else:
        rate = "uniform" if method == "MPT uniform" else 1 - cfg["context"] / num_data
        loss = MPTLoss(rate=rate, share_masks=True)
    svi = SVI(decoder.model, decoder.guide, pyro.optim.Adam({"lr": cfg["lr"]}), loss=loss)

    def predictive(codes):
        decoder.requires_grad_(False)  # only the test codes are fitted
        with _frozen_parameters_allowed():
            return decoder.predict(y, codes)

    def lml():
        with _frozen_parameters_allowed():
            return decoder.log_marginal(y).item()

    return (lambda: svi.step(y)), predictive, lml


@contextlib.contextmanager
def _frozen_parameters_allowed():
    """Silences ``pyro.module``'s note that frozen (``requires_grad=False``) kernel
    parameters stay out of the param store: scoring a trained model freezes them on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*requires_grad=False", category=UserWarning)
        yield


def _held_out_lpd(predictive, y_test, visible, init_codes, steps):
    """Fits test codes to the visible pixels, then scores the hidden ones (nats/pixel)."""
    codes = init_codes.clone().requires_grad_()
    optimizer = torch.optim.Adam([codes], lr=0.05)

    def log_density(codes):
        mean, var = predictive(codes)
        return torch.distributions.Normal(mean, var.sqrt()).log_prob(y_test)

    for _ in range(steps):
        optimizer.zero_grad()
        (-log_density(codes)[visible].sum()).backward()
        optimizer.step()
    with torch.no_grad():
        return log_density(codes)[~visible].mean().item()


def _train_and_score(method, data, cfg, bar):
    y, y_test, visible, init_codes, test_init = data
    # Warm-up: one step of a throwaway model (codes copied, random state restored), so that
    # one-off costs are not charged to the seconds per epoch of the first method timed.
    with common.preserved_rng():
        _make(method, y, cfg, init_codes.clone())[0]()
    step, predictive, lml = _make(method, y, cfg, init_codes)
    watch = common.Stopwatch()
    for _ in range(cfg["steps"]):
        step()
        bar.update()
    seconds = watch.elapsed / cfg["steps"]
    lpd = _held_out_lpd(predictive, y_test, visible, test_init, cfg["code_steps"])
    with torch.no_grad():
        return dict(lml_per_image=lml() / y.shape[0], held_out_lpd=lpd, seconds_per_epoch=seconds)


def _time_per_epoch(method, y, cfg, init_codes):
    if method == "exact LML" and y.shape[0] > cfg["exact_max"]:
        return None
    step, _, _ = _make(method, y, cfg, init_codes)
    step()  # warm-up
    times = []
    for _ in range(cfg["timing_steps"]):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times)


def _data(cfg, seed, device, num_data):
    images, _ = load_mnist(num_samples=num_data + cfg["T"], binarize=False, seed=seed)
    images = images.to(device=device, dtype=torch.get_default_dtype())
    y, y_test = images[:num_data], images[num_data:]
    mean = y.mean(0)
    return y - mean, y_test - mean


def _measure(cfg, device, seed, progress):
    """Every method's quality at ``N`` (:func:`_train_and_score`) and its seconds per epoch
    at each of ``cfg["sizes"]``."""
    quality, timing = {}, {m: [] for m in METHODS}
    work = len(METHODS) * (cfg["steps"] + len(cfg["sizes"]))
    with common.progress_bar(total=work, enabled=progress, desc=NAME, unit="step") as bar:
        y, y_test = _data(cfg, seed, device, cfg["N"])
        codes = _pca_codes(torch.cat([y, y_test]), cfg["Q"])
        init_codes, test_init = codes[: cfg["N"]], codes[cfg["N"] :]
        generator = torch.Generator(device="cpu").manual_seed(common.derived_seed(seed, 1))
        visible = (torch.rand(y_test.shape, generator=generator) < 0.5).to(device)
        data = (y, y_test, visible, init_codes, test_init)
        for index, method in enumerate(METHODS):
            common.seed_everything(common.derived_seed(seed, 2, index))
            quality[method] = _train_and_score(method, data, cfg, bar)
        for num_data in cfg["sizes"]:
            y_n, _ = _data(cfg, seed, device, num_data)
            codes_n = _pca_codes(y_n, cfg["Q"])
            for index, method in enumerate(METHODS):
                common.seed_everything(common.derived_seed(seed, 3, index, num_data))
                timing[method].append(_time_per_epoch(method, y_n, cfg, codes_n))
                bar.update()
    return quality, timing


def _report(cfg, measured):
    quality, timing = measured
    headers = ["method", "exact LML / image", "held-out LPD / pixel", "s/epoch"]
    headers += [f"s/epoch N={n}" for n in cfg["sizes"]]
    rows = []
    for method in METHODS:
        q = quality[method]
        row = [method, f"{q['lml_per_image']:.1f}", f"{q['held_out_lpd']:.3f}"]
        row += [f"{q['seconds_per_epoch']:.3f}"]
        row += ["-" if t is None else f"{t:.3f}" for t in timing[method]]
        rows.append(row)
    title = (
        f"GP decoders on grey MNIST (N={cfg['N']} training, {cfg['T']} held-out images with "
        f"half their pixels hidden, D=784, Q={cfg['Q']}, {cfg['steps']} full-batch Adam "
        f"steps, lr {cfg['lr']}, float32, {torch.get_num_threads()} threads)"
    )
    notes = [
        "exact LML per image in nats (Bayesian GP-LVM: at the means of q(X)); LPD: mean log "
        "density of hidden pixels after fitting the test codes to the visible ones.",
        "s/epoch N=...: fastest of a few full-batch steps on the first N images ('-': "
        "exact LML not run).",
    ]
    table = common.format_table(headers, rows, title=title, notes=notes)
    return Report(table, _figure(timing, cfg), dict(quality=quality, timing=timing))


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True):
    """GP decoders on MNIST; writes ``gp-decoder.json`` and ``gp-decoder.png``.

    ``smoke``: ``N = 48``, a few steps, ``N`` in ``(32, 64)`` for timing (seconds); ``full``:
    300 training steps instead of 100 (default ``N = 1000``, ``Q = 5``). ``seed`` sets the
    data subset, inducing points and masks. The steps are those of
    :func:`~experiments._experiment.run_experiment`, but the JSON keeps this
    experiment's own layout: ``config`` (the sizes alone), ``quality``, ``timing``,
    ``seconds``, with no ``experiment`` entry.
    """
    common.check_size(smoke, full)
    cfg = _config(smoke, full)
    total = common.Stopwatch()
    device = common.resolve_device(device)
    with common.default_dtype(torch.float32):
        measured = _measure(cfg, device, seed, progress)
    shown = _report(cfg, measured)
    print(shown.table)
    results = dict(config=cfg, **shown.results, seconds=total.elapsed)
    return common.save_outputs(out_dir, NAME, results, shown.figure)


def _figure(timing, cfg):
    fig, (ax,) = common.new_figure(1, width=5.5)
    for method, times in timing.items():
        points = [(n, t) for n, t in zip(cfg["sizes"], times) if t is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("N (training images)")
    ax.set_ylabel("seconds per epoch (full batch)")
    ax.set_title("GP decoders on MNIST: time vs N")
    ax.legend(fontsize=8)
    return fig
