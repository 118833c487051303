"""Every hand-written fast path of :mod:`pyro_mpt.ops` against the plain version it
replaces, forward and backward, at the sizes of the VAE benchmarks (float32).

* ``bernoulli quadrature``: :func:`~pyro_mpt.ops.quadrature_bernoulli.bernoulli_log_conditionals`
  (one product over the nodes per pixel value, hand-written backward) against what the
  quadrature conditionals of other tabulated likelihoods do, and binary data would get
  without it: the two-value table from the distribution's ``log_prob``, then
  :func:`~pyro_mpt.ops.quadrature_tabulated.tabulated_log_conditionals`, G=400 nodes,
  N=128 images, D=784 pixels;
* ``tabulated quadrature``: ``tabulated_log_conditionals`` (matrix products with the table,
  hand-written backward) against the plain
  :func:`~pyro_mpt.ops.quadrature_conditionals.quadrature_log_conditionals` on the
  ``(G, N, D)`` log-likelihoods, same sizes;
* ``importance``:
  :func:`~pyro_mpt.ops.self_normalised_importance.per_sample_importance_log_conditionals`
  (one sample at a time, hand-written backward) against
  :func:`~pyro_mpt.ops.self_normalised_importance.plain_importance_log_conditionals`
  (``logsumexp`` under autograd), S=16 samples. ``importance_log_conditionals`` takes the
  first on the CPU and the second elsewhere;
* ``every-mask average``:
  :func:`~pyro_mpt.ops.shared_sample_importance.every_mask_average` (hand-written backward
  whose weights are flushed to zero below the GEMM-safe floor) against
  :func:`~pyro_mpt.ops.shared_sample_importance.plain_every_mask_average` (``logsumexp``
  under autograd), through a decoder's output layer (H=200 hidden units to D=784 Bernoulli
  pixels, S=8 samples of N=100 images, as in ``vae-deep``) whose backward matrix products
  meet the weights. The log-ratios spread over the samples with a standard deviation of
  ``SPREAD`` nats, as a decoder's do; the report gives the share of the plain gradient's
  entries at the output layer that are subnormal;
* ``bernoulli log_prob``: :func:`~pyro_mpt.ops.bernoulli.bernoulli_log_prob` against
  ``torch.distributions.Bernoulli(logits).log_prob``, S x N x D entries;
* ``masks``: :func:`~pyro_mpt.ops.masks.masks_of_sizes` (16-bit keys sorted by NumPy)
  against :func:`~pyro_mpt.ops.masks.plain_masks_of_sizes` (float64 keys, ``torch.sort``).

A fast path earns its place at 1.3x or more; the script prints each ratio from one run, with
the calls interleaved. Run with ``--device cuda`` to see which pay off a GPU.

Usage::

    python benchmarks/bench_fast_paths.py [--threads 1] [--steps 5] [--repeats 5]
"""

import torch
from _common import benchmark_main, make_report, medians, print_results, time_calls

from pyro_mpt.ops.bernoulli import bernoulli_log_prob
from pyro_mpt.ops.masks import masks_of_sizes, plain_masks_of_sizes
from pyro_mpt.ops.quadrature_bernoulli import bernoulli_log_conditionals, bernoulli_log_table
from pyro_mpt.ops.quadrature_conditionals import quadrature_log_conditionals
from pyro_mpt.ops.quadrature_nodes import gauss_hermite_grid
from pyro_mpt.ops.quadrature_tabulated import tabulated_log_conditionals, value_indicators
from pyro_mpt.ops.self_normalised_importance import (
    per_sample_importance_log_conditionals,
    plain_importance_log_conditionals,
)
from pyro_mpt.ops.shared_sample_importance import every_mask_average, plain_every_mask_average

__all__ = ["main", "print_report", "run"]

NUM_POINTS, NUM_IMAGES, NUM_PIXELS, NUM_SAMPLES = 20, 128, 784, 16
#: The every-mask case: hidden units, samples and images of a ``vae-deep`` step, and the
#: standard deviation over samples of the log-ratios, in nats.
HIDDEN, EVERY_MASK_SAMPLES, EVERY_MASK_IMAGES, SPREAD = 200, 8, 100, 40.0
TARGET = 1.3


def _inputs(device, seed):
    """A linear decoder's logits at a 20 x 20 Gauss-Hermite grid, binary images and one
    uniform-size mask per image."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    nodes, log_weights = gauss_hermite_grid(NUM_POINTS, 2, torch.float32, device)
    weight = torch.randn(NUM_PIXELS, 2, generator=generator).to(device)
    logits = (nodes @ weight.T - 1.0).requires_grad_()
    images = (torch.rand(NUM_IMAGES, NUM_PIXELS, generator=generator) < 0.2).float().to(device)
    sizes = torch.randint(1, NUM_PIXELS + 1, (NUM_IMAGES,), generator=generator).to(device)
    masks = masks_of_sizes(sizes, NUM_PIXELS)
    return log_weights, logits, images, masks, sizes


def _backward(out, masks, *leaves):
    (out * masks).sum().backward()
    for leaf in leaves:
        leaf.grad = None


def _cases(device, seed):
    """name -> (fast call, plain call)."""
    log_weights, logits, images, masks, sizes = _inputs(device, seed)
    context = ~masks
    indicators = value_indicators(images.new_tensor([0.0, 1.0]), images)

    def bernoulli_fast():
        out = bernoulli_log_conditionals(log_weights, logits, images, context.unsqueeze(0))
        _backward(out, masks, logits)

    def bernoulli_plain():
        # The table as TabulatedQuadratureSelfPredictive builds it, (G, 2, D): values 0, 1.
        fn = torch.distributions.Bernoulli(logits=logits.unsqueeze(-2), validate_args=False)
        table = fn.log_prob(images.new_tensor([0.0, 1.0]).reshape(-1, 1))
        out = tabulated_log_conditionals(log_weights, table, indicators, context.unsqueeze(0))
        _backward(out, masks, logits)

    def dense_log_likelihoods():
        return torch.distributions.Bernoulli(logits=logits.unsqueeze(1)).log_prob(images)

    def tabulated_fast():
        table = bernoulli_log_table(logits)
        out = tabulated_log_conditionals(log_weights, table, indicators, context.unsqueeze(0))
        _backward(out, masks, logits)

    def tabulated_plain():
        out = quadrature_log_conditionals(log_weights, dense_log_likelihoods(), context)
        _backward(out, masks, logits)

    generator = torch.Generator(device="cpu").manual_seed(seed + 1)
    sample_logits = torch.randn(NUM_SAMPLES, 1, NUM_IMAGES, NUM_PIXELS, generator=generator)
    sample_logits = sample_logits.to(device).requires_grad_()
    sample_weights = torch.randn(NUM_SAMPLES, 1, NUM_IMAGES, generator=generator).to(device)

    def importance(fn):
        ll = bernoulli_log_prob(sample_logits, images)
        out = fn(sample_weights, ll, context.unsqueeze(0))
        _backward(out, masks, sample_logits)

    def log_prob_fast():
        bernoulli_log_prob(sample_logits, images).sum().backward()
        sample_logits.grad = None

    def log_prob_plain():
        torch.distributions.Bernoulli(logits=sample_logits).log_prob(images).sum().backward()
        sample_logits.grad = None

    return {
        "bernoulli quadrature": (bernoulli_fast, bernoulli_plain),
        "every-mask average": _every_mask_case(device, seed),
        "tabulated quadrature": (tabulated_fast, tabulated_plain),
        "importance": (
            lambda: importance(per_sample_importance_log_conditionals),
            lambda: importance(plain_importance_log_conditionals),
        ),
        "bernoulli log_prob": (log_prob_fast, log_prob_plain),
        "masks": (
            lambda: masks_of_sizes(sizes, NUM_PIXELS),
            lambda: plain_masks_of_sizes(sizes, NUM_PIXELS),
        ),
    }


def _every_mask_inputs(device, seed):
    """A decoder output layer's weights, hidden activations, binary images and log-ratios."""
    generator = torch.Generator(device="cpu").manual_seed(seed + 2)
    samples, images = EVERY_MASK_SAMPLES, EVERY_MASK_IMAGES
    hidden = torch.tanh(torch.randn(samples, images, HIDDEN, generator=generator))
    weight = 0.3 * torch.randn(NUM_PIXELS, HIDDEN, generator=generator)
    pixels = (torch.rand(images, NUM_PIXELS, generator=generator) < 0.2).float()
    log_ratios = SPREAD * torch.randn(samples, images, generator=generator)
    tensors = hidden.requires_grad_(), weight.requires_grad_(), pixels, log_ratios
    return [t.to(device) if t.is_leaf else t for t in tensors]


def _every_mask_backward(average, hidden, weight, pixels, log_ratios):
    """The output layer's logits, the pixels' log-likelihood, the average and its backward;
    returns the gradient at the logits."""
    logits = hidden @ weight.T
    logits.retain_grad()
    average(log_ratios, bernoulli_log_prob(logits, pixels).sum(-1)).sum().backward()
    hidden.grad = weight.grad = None
    return logits.grad


def _every_mask_case(device, seed):
    inputs = _every_mask_inputs(device, seed)
    return (
        lambda: _every_mask_backward(every_mask_average, *inputs),
        lambda: _every_mask_backward(plain_every_mask_average, *inputs),
    )


def subnormal_share(device="cpu", seed=0):
    """The share of the plain every-mask gradient's entries at the logits that are
    subnormal, and the same for the flushed one (0 if the flushing works)."""
    inputs = _every_mask_inputs(torch.device(device), seed)
    tiny = torch.finfo(torch.float32).tiny
    shares = []
    for average in (plain_every_mask_average, every_mask_average):
        grad = _every_mask_backward(average, *inputs).abs()
        shares.append(float(((grad > 0) & (grad < tiny)).float().mean()))
    return shares


def run(device="cpu", steps=5, repeats=5, seed=0):
    """Times every fast path and its plain version; returns ``{"config", "environment",
    "results"}``."""
    device = torch.device(device)
    results = []
    for name, (fast, plain) in _cases(device, seed).items():
        ms = medians(time_calls({"fast": fast, "plain": plain}, device, steps, repeats, warmup=1))
        speedup = ms["plain"] / ms["fast"]
        results.append(
            {"path": name, "fast_ms": ms["fast"], "plain_ms": ms["plain"], "speedup": speedup}
        )
    config = dict(nodes=NUM_POINTS**2, images=NUM_IMAGES, pixels=NUM_PIXELS, samples=NUM_SAMPLES)
    config["target_speedup"] = TARGET
    plain_share, fast_share = subnormal_share(device, seed)
    config.update(
        every_mask=dict(
            hidden=HIDDEN,
            samples=EVERY_MASK_SAMPLES,
            images=EVERY_MASK_IMAGES,
            spread=SPREAD,
            plain_subnormal_share=plain_share,
            fast_subnormal_share=fast_share,
        )
    )
    return make_report(device, results, config, steps=steps, repeats=repeats)


def print_report(report):
    print_results(
        report,
        "path: {path} | fast ms: {fast_ms:.2f} | plain ms: {plain_ms:.2f} | "
        "speedup: {speedup:.2f}x | >= 1.3x: {meets}",
        "Fast paths against their plain versions, forward and backward, float32 ({device}, "
        "{threads} threads; G={nodes} N={images} D={pixels} S={samples}; median of {repeats} x "
        "{steps})",
        meets=lambda r: "yes" if r["speedup"] >= report["config"]["target_speedup"] else "no",
    )
    every = report["config"]["every_mask"]
    print(
        f"every-mask average: H={every['hidden']} S={every['samples']} N={every['images']}, "
        f"log-ratios spread {every['spread']:g} nats; subnormal entries of the gradient at the "
        f"logits: {every['plain_subnormal_share']:.1%} plain, "
        f"{every['fast_subnormal_share']:.1%} flushed"
    )


def main(argv=None):
    return benchmark_main(__doc__, argv, run, print_report, steps=5, repeats=5)


if __name__ == "__main__":
    main()
