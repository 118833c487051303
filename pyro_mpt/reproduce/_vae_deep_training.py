"""The rows of ``vae-deep`` and how one is trained: each row's likelihood, MPT rate,
conditionals and encoder objective (:data:`METHODS`, :data:`GAUSSIAN_METHODS`), its loss
(:func:`make_loss`), the importance-sampling LML that evaluates it
(:func:`mean_log_marginal`), and its training loop with the per-epoch records
(:func:`train_row`)."""

import pyro
import torch
from pyro.infer import Trace_ELBO

from pyro_mpt import MPTLoss, log_marginal
from pyro_mpt.conditionals import EncodeDecode, Importance
from pyro_mpt.models import VAE
from pyro_mpt.reproduce import _common as common

__all__ = [
    "ALL_METHODS",
    "GAUSSIAN_METHODS",
    "METHODS",
    "make_loss",
    "mean_log_marginal",
    "train_row",
]


def _method(likelihood, rate, conditionals, encoder="ELBO", **more):
    """One row: its likelihood, MPT rate, conditionals, encoder objective and further options."""
    return dict(
        likelihood=likelihood, rate=rate, conditionals=conditionals, encoder=encoder, **more
    )


#: Rows of the Bernoulli VAE on binarised pixels: name -> how it is trained. ``rate`` is the
#: MPT rate (``None`` for the ELBO), ``conditionals`` one of ``"encode-decode"`` (refill with
#: the decoder mean), ``"encode-decode-sample"`` (refill with a draw) or ``"importance"``,
#: ``encoder`` what trains the encoder.
METHODS = {
    "ELBO": _method("bernoulli", None, None),
    "MPT 33%": _method("bernoulli", 0.33, "encode-decode"),
    "MPT uniform": _method("bernoulli", "uniform", "encode-decode"),
    "MPT 33%, encoder by MPT": _method("bernoulli", 0.33, "encode-decode", encoder="MPT"),
}

#: Rows of the Gaussian VAE on grey pixels (the paper's model), as :data:`METHODS`, with
#: ``num_masks`` masks per observation and step where it is not 1.
#: ``Gaussian MPT 33%, encode-decode`` is the paper's configuration.
GAUSSIAN_METHODS = {
    "Gaussian ELBO": _method("normal", None, None),
    "Gaussian MPT 33%, encode-decode": _method("normal", 0.33, "encode-decode-sample"),
    "Gaussian MPT 33%, encode-decode, 4 masks": _method(
        "normal", 0.33, "encode-decode-sample", num_masks=4
    ),
    "Gaussian MPT uniform, encode-decode": _method("normal", "uniform", "encode-decode-sample"),
    "Gaussian MPT 33%, importance": _method("normal", 0.33, "importance"),
    "Gaussian MPT uniform, importance": _method("normal", "uniform", "importance"),
}

#: Every row, Bernoulli then Gaussian.
ALL_METHODS = {**METHODS, **GAUSSIAN_METHODS}


def make_loss(method, cfg):
    """The training loss of one row (a dict of :data:`METHODS` or :data:`GAUSSIAN_METHODS`):
    ``Trace_ELBO`` or an ``MPTLoss`` whose ``guide_loss`` is ``"elbo"`` unless the row's
    encoder is trained by MPT."""
    if method["rate"] is None:
        return Trace_ELBO()
    kind = method["conditionals"]
    if kind == "importance":
        conditionals = Importance(num_samples=cfg["train_samples"], fill="mean")
    elif kind in ("encode-decode", "encode-decode-sample"):
        refill = "sample" if kind == "encode-decode-sample" else "mean"
        conditionals = EncodeDecode(num_iterations=cfg["iterations"], refill=refill)
    else:
        raise ValueError(
            f"conditionals must be 'encode-decode', 'encode-decode-sample' or 'importance', "
            f"got {kind!r}."
        )
    guide_loss = "elbo" if method["encoder"] == "ELBO" else None
    return MPTLoss(
        rate=method["rate"],
        num_masks=method.get("num_masks", 1),
        conditionals=conditionals,
        guide_loss=guide_loss,
    )


def mean_log_marginal(vae, x, num_samples, chunk):
    """Mean importance estimate of ``log p(x)`` per observation (``num_samples`` guide
    samples on the full data), in chunks of ``chunk`` observations, on its own random
    numbers so that evaluating does not change the training."""
    total = 0.0
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for part in x.split(chunk):
            values = log_marginal(
                vae.model, part, conditionals=Importance(num_samples), guide=vae.guide
            )
            total += float(values.sum())
    return total / x.shape[0]


def train_row(name, data, cfg, seed, bar):
    """Trains row ``name`` from the shared initialisation on ``data[likelihood]``
    (``(training, evaluation subset, held-out)``) and records its curves per epoch, the
    held-out LML at the end and the learned noise scale (Gaussian rows)."""
    method = ALL_METHODS[name]
    x, x_eval, x_test = data[method["likelihood"]]
    pyro.clear_param_store()
    common.seed_everything(common.derived_seed(seed, 1))  # the same initialisation for every method
    vae = VAE(
        784,
        latent_dim=cfg["K"],
        hidden_dim=cfg["hidden"],
        likelihood=method["likelihood"],
        noise_scale=cfg["noise_scale"],
    )
    vae = vae.to(device=x.device, dtype=x.dtype)  # float32 whatever the default dtype
    optimizer = torch.optim.Adam(vae.parameters(), lr=cfg["lr"])
    loss_fn = make_loss(method, cfg)

    def evaluate():
        return (
            mean_log_marginal(vae, x_eval, cfg["eval_samples"], cfg["eval_chunk"]),
            mean_log_marginal(vae, x_test, cfg["eval_samples"], cfg["eval_chunk"]),
        )

    initial, initial_test = evaluate()
    common.seed_everything(common.derived_seed(seed, 2))  # the same mini-batches for every method
    objective, lml, test_lml, seconds = [], [], [], []
    for _ in range(cfg["epochs"]):
        values = []
        with common.Stopwatch() as clock:
            for idx in torch.randperm(x.shape[0], device=x.device).split(cfg["batch"]):
                optimizer.zero_grad()
                loss = loss_fn.differentiable_loss(vae.model, vae.guide, x[idx]) / len(idx)
                loss.backward()
                optimizer.step()
                values.append(-float(loss.detach()))
        seconds.append(clock.seconds)
        objective.append(sum(values) / len(values))
        train_value, test_value = evaluate()
        lml.append(train_value)
        test_lml.append(test_value)
        bar.update()
        bar.set_postfix_str(f"{name}: held-out LML {test_value:.1f}")
    final = mean_log_marginal(vae, x_test, cfg["final_samples"], max(1, cfg["eval_chunk"] // 4))
    noise = None if method["likelihood"] != "normal" else float(vae.noise_scale.detach())
    pyro.clear_param_store()
    return dict(
        objective=objective,
        log_marginal=lml,
        held_out_log_marginal=test_lml,
        initial_log_marginal=initial,
        initial_held_out_log_marginal=initial_test,
        test_log_marginal=final,
        noise_scale=noise,
        seconds_per_epoch=seconds,
    )
