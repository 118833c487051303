"""The rows of ``vae-deep`` and how one is trained: each row's group (likelihood and latent
size) and objective (:data:`ALL_METHODS`), its loss (:func:`make_loss`), the cheap
per-epoch LML with the run's own encoder (:func:`mean_log_marginal`), one training run
with its per-epoch records (:func:`train_run`), and the interleaved timing of one step of
every row against a ``Trace_ELBO`` step (:func:`step_seconds`)."""

import contextlib
import statistics
import warnings

import pyro
import torch
from pyro.infer import RenyiELBO, Trace_ELBO

from experiments import _common as common
from pyro_mpt import MPTLoss, log_marginal
from pyro_mpt.conditionals import ImportanceSampling
from pyro_mpt.models import VAE

__all__ = [
    "ALL_METHODS",
    "EVERY_MASK",
    "GAUSSIAN_METHODS",
    "GROUPS",
    "METHODS",
    "OBJECTIVES",
    "SMALL_LATENT_METHODS",
    "count_warnings",
    "describe_loss",
    "make_loss",
    "masks_text",
    "mean_log_marginal",
    "new_vae",
    "own_random_numbers",
    "step_seconds",
    "weight_figures",
    "train_run",
    "unavailable",
]

#: Groups of rows: name -> (likelihood, latent size). Rows of one group share the data and,
#: per seed, the initialisation; they are compared with the group's ELBO row.
GROUPS = {
    "Bernoulli K=2": ("bernoulli", 2),
    "Bernoulli K=16": ("bernoulli", 16),
    "Gaussian K=16": ("normal", 16),
}

#: Objectives of a group: label -> (loss kind, ``MPTLoss`` guide_loss, where the draws
#: come from: ``"masks"``, some of the masks; ``"masks+unmasked"``, one mask and the guide
#: on the unmasked image; ``"unmasked"``, the guide on the unmasked image only;
#: ``"every mask"``, the same draws with the average over every mask taken exactly,
#: ``num_masks="all"``, the wake update toward ``p(z | x)`` and one context drawn at the
#: uniform rate; ``"every mask, full context"``, the same with the wake update toward
#: ``p(z | x)`` only, ``wake_contexts=0``). ``"iwae"``
#: is ``RenyiELBO(alpha=0)`` with as many particles as the MPT rows' importance samples.
OBJECTIVES = {
    "ELBO": ("elbo", None, None),
    "IWAE": ("iwae", None, None),
    "MPT, guide_loss=None": ("mpt", None, "masks"),
    "MPT, guide_loss='elbo'": ("mpt", "elbo", "masks"),
    "MPT, guide_loss='wake'": ("mpt", "wake", "masks"),
    "MPT, guide_loss='wake', unmasked proposal": ("mpt", "wake", "masks+unmasked"),
    "MPT, guide_loss='wake', unmasked proposal only": ("mpt", "wake", "unmasked"),
    "MPT, guide_loss='wake', every mask": ("mpt", "wake", "every mask"),
    "MPT, guide_loss='wake', every mask, wake toward p(z | x) only": (
        "mpt",
        "wake",
        "every mask, full context",
    ),
}

#: The ``proposals`` of the rows over every mask.
EVERY_MASK = ("every mask", "every mask, full context")


def _rows(group):
    likelihood, latent = GROUPS[group]
    return {
        f"{group}: {label}": dict(
            group=group,
            likelihood=likelihood,
            latent_dim=latent,
            label=label,
            loss_kind=loss_kind,
            guide_loss=guide_loss,
            proposals=proposals,
        )
        for label, (loss_kind, guide_loss, proposals) in OBJECTIVES.items()
    }


#: The Bernoulli rows at latent size 16 (those ``vae-compare`` runs): name -> row.
METHODS = _rows("Bernoulli K=16")
#: The Bernoulli rows at latent size 2, where quadrature checks the held-out LML.
SMALL_LATENT_METHODS = _rows("Bernoulli K=2")
#: The Gaussian rows on grey pixels (the paper's likelihood).
GAUSSIAN_METHODS = _rows("Gaussian K=16")
#: Every row, group by group in the order of :data:`GROUPS`.
ALL_METHODS = {**SMALL_LATENT_METHODS, **METHODS, **GAUSSIAN_METHODS}


def make_loss(method, cfg):
    """The training loss of one row (a value of :data:`ALL_METHODS`): ``Trace_ELBO``, the
    IWAE bound ``RenyiELBO(alpha=0, num_particles=S)``, or ``MPTLoss(rate="uniform",
    num_masks=P, conditionals=ImportanceSampling(num_samples=S // Q, share_samples=True,
    num_proposals=Q), guide_loss=...)``, with ``S = cfg["train_samples"]``,
    ``P = cfg["train_masks"]`` (1 when absent) and ``Q = cfg["train_proposals"]`` (``P``
    when absent): ``P`` masks per image, ``Q`` of which draw ``S // Q`` samples each; the
    draws are pooled, so that every mask's conditionals use ``S`` samples and the model
    runs ``S`` times per image, as IWAE's. The row with the unmasked proposal draws
    ``S // 2`` from one of the masks and ``S // 2`` from the guide on the unmasked image
    (``num_proposals=1, unmasked_proposal=True``), the row with the unmasked proposal only
    all ``S`` from the guide on the unmasked image (``num_proposals=0``), with
    ``cfg["unmasked_only_masks"]`` masks per image (``P`` when absent): ``S`` draws per
    image too. The rows over every mask take the same draws and average over every mask
    exactly (``num_masks="all"``), one with the wake update's default contexts, one with
    ``wake_contexts=0``."""
    kind, samples = method["loss_kind"], cfg["train_samples"]
    if kind == "elbo":
        return Trace_ELBO(max_plate_nesting=1)
    if kind == "iwae":
        return RenyiELBO(
            alpha=0, num_particles=samples, vectorize_particles=True, max_plate_nesting=1
        )
    if kind == "mpt":
        masks = cfg.get("train_masks", 1)
        proposals = min(cfg.get("train_proposals", masks), masks)
        if method["proposals"] in ("masks+unmasked", "unmasked", *EVERY_MASK):
            only = method["proposals"] != "masks+unmasked"
            options = {}
            if method["proposals"] in EVERY_MASK:
                masks = "all"
                if method["proposals"] == "every mask, full context":
                    options = dict(wake_contexts=0)
            elif only:
                masks = cfg.get("unmasked_only_masks", masks)
            conditionals = ImportanceSampling(
                num_samples=samples if only else max(1, samples // 2),
                share_samples=True,
                num_proposals=0 if only else 1,
                unmasked_proposal=True,
                **options,
            )
        else:
            conditionals = ImportanceSampling(
                num_samples=samples // proposals,
                share_samples=masks > 1,
                num_proposals=proposals if proposals < masks else None,
            )
        return MPTLoss(
            rate="uniform",
            num_masks=masks,
            conditionals=conditionals,
            guide_loss=method["guide_loss"],
            max_plate_nesting=1,
        )
    raise ValueError(
        f"loss_kind must be 'elbo', 'iwae' or 'mpt', got {kind!r}; pick a row of ALL_METHODS."
    )


def masks_text(cfg, proposals="masks"):
    """How the MPT rows' masks use the draws, in words, e.g. "P=16 masks per image, Q=4 of
    which draw, the draws pooled"; ``proposals`` as in :data:`OBJECTIVES`."""
    masks = cfg.get("train_masks", 1)
    if proposals in EVERY_MASK:
        return (
            f"every mask, averaged exactly, the unmasked image drawing all {cfg['train_samples']}"
        )
    if proposals == "unmasked":
        return (
            f"P={cfg.get('unmasked_only_masks', masks)} masks per image, the unmasked image "
            f"drawing all {cfg['train_samples']}"
        )
    if proposals == "masks+unmasked":
        half = max(1, cfg["train_samples"] // 2)
        return (
            f"P={masks} masks per image, one of which and the unmasked image draw {half} "
            f"each, the draws pooled"
        )
    proposals = min(cfg.get("train_proposals", masks), masks)
    if masks == 1:
        return "P=Q=1 mask per image"
    if proposals == masks:
        return f"P=Q={masks} masks per image, each drawing, the draws pooled"
    return f"P={masks} masks per image, Q={proposals} of which draw, the draws pooled"


def describe_loss(method, cfg):
    """The row's loss as the result file records it (its constructor call)."""
    kind, samples = method["loss_kind"], cfg["train_samples"]
    if kind == "elbo":
        return "Trace_ELBO()"
    if kind == "iwae":
        return f"RenyiELBO(alpha=0, num_particles={samples}, vectorize_particles=True)"
    return repr(make_loss(method, cfg))


def unavailable(method, cfg):
    """Why this ``MPTLoss`` cannot build the row's loss (an option it does not accept yet),
    or ``None`` when it can."""
    try:
        make_loss(method, cfg)
    except ValueError as error:
        if method["loss_kind"] == "mpt" and "guide_loss" in str(error):
            return f"guide_loss={method['guide_loss']!r} is not accepted here: {error}"
        raise
    return None


def new_vae(method, cfg, init_seed, like):
    """A VAE of the row's likelihood and latent size, initialised from ``init_seed``, in the
    dtype and on the device of ``like``. Clears Pyro's param store first: VAE parameters
    live there under fixed names, so only the newest VAE may be used."""
    pyro.clear_param_store()
    common.seed_everything(init_seed)
    vae = VAE(
        784,
        latent_dim=method["latent_dim"],
        hidden_dim=cfg["hidden"],
        likelihood=method["likelihood"],
        noise_scale=cfg["noise_scale"],
    )
    return vae.to(device=like.device, dtype=like.dtype)


@contextlib.contextmanager
def count_warnings(category_name, counts, key):
    """Counts in ``counts[key]`` the warnings whose class is named ``category_name`` (the
    importance diagnostics' ``ImportanceAccuracyWarning``, which this library may not have
    yet) raised inside the block, and passes every other warning on."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        yield
    for item in caught:
        if type(item.message).__name__ == category_name:
            counts[key] = counts.get(key, 0) + 1
        else:
            warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)


@contextlib.contextmanager
def own_random_numbers(seed, device):
    """Runs the block on torch random numbers seeded by ``seed`` and restores the state of
    the CPU (and of ``device``, a GPU) afterwards, so that evaluating changes no training."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def mean_log_marginal(vae, x, num_samples, chunk):
    """Mean importance estimate of ``log p(x)`` per observation (``num_samples`` guide
    samples on the full data: the IWAE bound with the model's own encoder), in chunks of
    ``chunk`` observations, on its own random numbers so that evaluating does not change
    the training."""
    total = 0.0
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for part in x.split(chunk):
            values = log_marginal(
                vae.model, part, conditionals=ImportanceSampling(num_samples), guide=vae.guide
            )
            total += float(values.sum())
    return total / x.shape[0]


def weight_figures(diagnostics):
    """The importance weights of an MPT row's last training batch in plain numbers: the
    median ESS of the rows toward ``p(z | x)`` with every pixel in the context (for the
    row over every mask; of every (mask, image) row otherwise), the median Pareto k-hat,
    and the mean empty-context term (None except over every mask)."""
    if diagnostics is None:
        return None
    summary = diagnostics.summary()
    ess = diagnostics.ess[0] if diagnostics.empty_context is not None else diagnostics.ess
    empty = summary["empty_context"]
    return dict(
        median_ess=float(ess[~ess.isnan()].median()),
        median_k=summary["median_k"],
        empty_context=None if empty != empty else empty,
    )


def _step(loss_fn, vae, optimizer, batch):
    """One Adam step on ``batch``; returns the objective per observation before the step."""
    optimizer.zero_grad()
    value = loss_fn.loss_and_grads(vae.model, vae.guide, batch)
    optimizer.step()
    return -value / batch.shape[0]


def train_run(method, data, cfg, seeds, bar=None):
    """Trains one row from its group's initialisation for one seed.

    :param dict method: a value of :data:`ALL_METHODS`.
    :param tuple data: ``(training images, training subset, held-out subset)``; the
        subsets are evaluated after every epoch.
    :param dict seeds: ``init`` (the group's initialisation), ``batches`` (the order of the
        mini-batches, shared by the rows), ``evaluation`` (the random numbers of the
        per-epoch LML).
    :returns: ``(record, state)``: the per-epoch record (objective, own-encoder LML of both
        subsets, seconds) and the trained parameters.
    """
    x, x_train_eval, x_eval = data
    vae = new_vae(method, cfg, seeds["init"], x)
    optimizer = torch.optim.Adam(vae.parameters(), lr=cfg["lr"])
    loss_fn = make_loss(method, cfg)
    counts = {}

    def evaluate():
        with (
            own_random_numbers(seeds["evaluation"], x.device),
            count_warnings("ImportanceAccuracyWarning", counts, "evaluation"),
        ):
            return tuple(
                mean_log_marginal(vae, part, cfg["eval_samples"], cfg["eval_chunk"])
                for part in (x_train_eval, x_eval)
            )

    initial, initial_held_out = evaluate()
    common.seed_everything(seeds["batches"])
    record = dict(objective=[], log_marginal=[], held_out_log_marginal=[], seconds_per_epoch=[])
    record["weights"] = [] if method["loss_kind"] == "mpt" else None
    for _ in range(cfg["epochs"]):
        with (
            common.Stopwatch() as clock,
            count_warnings("ImportanceAccuracyWarning", counts, "training"),
        ):
            values = [
                _step(loss_fn, vae, optimizer, x[idx])
                for idx in torch.randperm(x.shape[0], device=x.device).split(cfg["batch"])
            ]
        record["seconds_per_epoch"].append(clock.seconds)
        if record["weights"] is not None:
            record["weights"].append(weight_figures(loss_fn.diagnostics))
        record["objective"].append(sum(values) / len(values))
        train_value, held_out_value = evaluate()
        record["log_marginal"].append(train_value)
        record["held_out_log_marginal"].append(held_out_value)
        if bar is not None:
            bar.update()
            bar.set_postfix_str(f"{method['label']}: held-out LML {held_out_value:.1f}")
    record.update(
        initial_log_marginal=initial,
        initial_held_out_log_marginal=initial_held_out,
        importance_warnings={k: counts.get(k, 0) for k in ("training", "evaluation")},
    )
    if method["likelihood"] == "normal":
        record["noise_scale"] = float(vae.noise_scale.detach())
    state = {k: v.detach().clone() for k, v in vae.state_dict().items()}
    pyro.clear_param_store()
    return record, state


def step_seconds(methods, cfg, x, init_seed):
    """Median seconds of one training step (loss, gradients, Adam) of each row of one group
    and of a ``Trace_ELBO`` step (key ``"Trace_ELBO"``), on one mini-batch of ``x``.

    The losses take turns, ``cfg["timing_rounds"]`` rounds of ``cfg["timing_steps"]`` steps
    each after two warm-up steps, so that a slow spell of the machine touches every loss
    alike; the median over the rounds discards the spells.
    """
    first = next(iter(methods.values()))
    losses = {"Trace_ELBO": Trace_ELBO(max_plate_nesting=1)}
    losses.update((name, make_loss(m, cfg)) for name, m in methods.items())
    vae = new_vae(first, cfg, init_seed, x)
    optimizer = torch.optim.Adam(vae.parameters(), lr=cfg["lr"])
    batch = x[: cfg["batch"]]
    seconds = {name: [] for name in losses}
    with own_random_numbers(init_seed, x.device), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # counted in the training runs, not here
        for loss_fn in losses.values():
            for _ in range(2):
                _step(loss_fn, vae, optimizer, batch)
        for _ in range(cfg["timing_rounds"]):
            for name, loss_fn in losses.items():
                with common.Stopwatch() as clock:
                    for _ in range(cfg["timing_steps"]):
                        _step(loss_fn, vae, optimizer, batch)
                seconds[name].append(clock.seconds / cfg["timing_steps"])
    pyro.clear_param_store()
    return {name: statistics.median(values) for name, values in seconds.items()}
