"""Reproductions of the paper's experiments, one module each, run by ``pyro-mpt reproduce``.

Every module exposes ``run(out_dir, device="cpu", smoke=False, full=False, seed=0,
progress=True) -> dict``, which prints a table, writes ``<name>.json`` and ``<name>.png``
into ``out_dir`` and returns the results. Each reads as config -> measure (train and
evaluate) -> report, the flow :mod:`experiments._experiment` runs; ``bert-rates`` and
``gp-decoder`` take those steps themselves, because their result files keep older layouts.
"""

import importlib

__all__ = ["EXPERIMENTS", "get_experiment"]

#: Experiment name -> (module, one-line description).
EXPERIMENTS = {
    "ppca-table1": (
        "experiments.ppca_table1",
        "Table 1: cumulative MPT estimate vs true LML for P = 1, 10, 100 (PPCA D=200)",
    ),
    "ppca-convergence": (
        "experiments.ppca_convergence",
        "Fig. 1: relative error of MPT vs P for D=5, 50 and D=512 at a fixed 15% rate",
    ),
    "ppca-training": (
        "experiments.ppca_training",
        "Fig. 2: training PPCA with MPTLoss (uniform and fixed 20% rate; no ELBO) vs exact LML",
    ),
    "ppca-curve": (
        "experiments.ppca_curve",
        "Fig. 4: MPT curves S(x; M) and their area vs exact LML (P=1, P=100, K=50)",
    ),
    "ppca-curve-training": (
        "experiments.ppca_curve_training",
        "Fig. 5 left: MPT curve of a PPCA at epochs 0-600 of MPT training; area vs exact LML",
    ),
    "vae-linear": (
        "experiments.vae_linear",
        "Fig. 3 top: linear Bernoulli VAE on MNIST, ELBO vs MPT (quadrature), LML per epoch",
    ),
    "vae-deep": (
        "experiments.vae_deep",
        "Fig. 3 bottom: deep VAE on MNIST (Gaussian and Bernoulli), MPT vs ELBO, LML per epoch",
    ),
    "gp-decoder": (
        "experiments.gp_decoder_mnist",
        "GP decoders on MNIST: MPT active sets vs Bayesian GP-LVM (ELBO) vs exact LML, time vs N",
    ),
    "vae-compare": (
        "experiments.vae_compare",
        "vae-linear and vae-deep in one table: final and held-out LML, s/epoch per objective",
    ),
    "bert-curve": (
        "experiments.bert_curve",
        "Fig. 5 / Table 2: MPT curve and area of an antibody BERT, pre-trained vs random init.",
    ),
    "mae-curve": (
        "experiments.mae_curve",
        "Fig. 6: ViT-MAE on MNIST trained at 75%, a random ratio and uniform; curves, probe",
    ),
    "bert-rates": (
        "experiments.bert_rates",
        "R2MAE vs BERT: small BERT on BBC News, fixed 15% vs uniform vs random-ratio masking",
    ),
    "mlm-generation": (
        "experiments.mlm_generation",
        "Antibody BERT samples from masked starts: sequential vs parallel vs mask-predict",
    ),
    "gibbs-mixing": (
        "experiments.gibbs_mixing",
        "Block Gibbs on PPCA and a bimodal model: ESS vs k, joint vs product, and size-k MPT",
    ),
    "coherence": (
        "experiments.coherence",
        "Chain-rule sums over orderings: exact PPCA, a deep VAE's importance and encode-decode, "
        "AntiBERTy",
    ),
}


def get_experiment(name):
    """The module of experiment ``name``.

    :raises ValueError: for an unknown name, listing the known ones.
    """
    if name not in EXPERIMENTS:
        known = ", ".join(EXPERIMENTS)
        raise ValueError(f"unknown experiment {name!r}; choose one of: {known}.")
    return importlib.import_module(EXPERIMENTS[name][0])
