"""Variational autoencoders (linear and MLP) as Pyro modules.

Both models share one layout, on which the MPT conditionals rely:

* ``model(x)`` and ``guide(x, hidden=None)`` take the data ``x`` of shape ``(N, D)`` as
  their first argument, and put the local latent ``z`` (shape ``(N, K)``) in a
  ``pyro.plate("data", N)`` at ``dim=-1``; the observed site is ``"x"``, with the ``D``
  features as one event.
* :meth:`~LinearVAE.guide` encodes the ``x`` it is given together with ``hidden``, booleans
  of the shape of ``x`` that are ``True`` at entries it must not read: the encoder's input is
  ``x`` with its hidden entries set to 0 and, beside it, the hidden indicator (``2 D``
  numbers per observation), so it can tell a hidden entry from an observed 0 and learn
  :math:`q(z \\mid x_R)` for any set ``R`` of visible features (partial-VAE style).
  ``hidden=None`` (ordinary ``Trace_ELBO`` training) means nothing is hidden; the masked
  conditionals (``"importance"``, ``"encode-decode"``) pass the mask of every masked copy.
* Every operation broadcasts over extra leading batch dimensions of ``x`` and ``z``: the
  model runs inside outer plates (e.g. ``pyro.plate("particles", S, dim=-2)``), with ``z``
  of shape ``(S, N, K)`` or ``(S, 1, N, K)``, and the guide accepts ``x`` of shape
  ``(..., N, D)``.
"""

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.distributions import constraints
from pyro.nn import PyroModule, PyroParam, pyro_method

from pyro_mpt.errors import check_positive_int
from pyro_mpt.models._data import check_data_dtype
from pyro_mpt.models._param_store import check_stored_shapes

__all__ = ["LinearVAE", "VAE"]

_LIKELIHOODS = ("bernoulli", "normal")
_MIN_SCALE = 1e-4


class _AutoEncoderModel(PyroModule):
    """Shared model, guide and sampler; subclasses define :meth:`encode` and :meth:`decode`."""

    def _init_common(self, num_features, latent_dim, likelihood, subsample_size):
        if likelihood not in _LIKELIHOODS:
            raise ValueError(f"likelihood must be 'bernoulli' or 'normal', got {likelihood!r}.")
        self.num_features = check_positive_int("num_features", num_features)
        self.latent_dim = check_positive_int("latent_dim", latent_dim)
        self.likelihood = likelihood
        self.subsample_size = subsample_size

    def _plate(self, x):
        return pyro.plate("data", x.shape[-2], subsample_size=self.subsample_size, dim=-1)

    def _select(self, x, idx):
        return x if self.subsample_size is None else x.index_select(-2, idx)

    def _check_data(self, x):
        check_data_dtype(x, self)
        if x.dim() < 2 or x.shape[-1] != self.num_features:
            raise ValueError(
                f"x must have shape (N, {self.num_features}) (num_features={self.num_features}),"
                f" got {tuple(x.shape)}; pass one observation per row."
            )

    def _check_hidden(self, x, hidden):
        if hidden is None:
            return
        try:
            torch.broadcast_shapes(hidden.shape, x.shape)
        except RuntimeError:
            raise ValueError(
                f"hidden must broadcast to the shape of x, {tuple(x.shape)}, got "
                f"{tuple(hidden.shape)}; pass one flag per entry of x (True where hidden)."
            ) from None

    def _encoder_input(self, x, hidden):
        """The encoder's input, ``(..., 2 D)``: ``x`` with its hidden entries set to 0, and
        the hidden indicator (all 0 for ``hidden=None``)."""
        if hidden is None:
            return torch.cat([x, torch.zeros_like(x)], -1)
        x, hidden = torch.broadcast_tensors(x, hidden.to(torch.bool))
        visible = torch.where(hidden, torch.zeros((), dtype=x.dtype, device=x.device), x)
        return torch.cat([visible, hidden.to(x.dtype)], -1)

    def observation_dist(self, z):
        """The per-feature distribution of ``x`` given codes ``z`` of shape ``(..., K)``:
        ``Bernoulli(logits)`` or ``Normal(loc, scale)``, batch shape ``(..., D)``."""
        params = self.decode(z)
        if self.likelihood == "bernoulli":
            return dist.Bernoulli(logits=params)
        return dist.Normal(params, self.noise_scale.expand(self.num_features))

    @pyro_method
    def model(self, x):
        """The generative model; ``x`` has shape ``(N, D)``."""
        self._check_data(x)
        with self._plate(x) as idx:
            # A tensor scale: a Python float would be copied to the device at every call.
            prior = dist.Normal(x.new_zeros(self.latent_dim), x.new_ones(()))
            z = pyro.sample("z", prior.to_event(1))
            pyro.sample("x", self.observation_dist(z).to_event(1), obs=self._select(x, idx))

    @pyro_method
    def guide(self, x, hidden=None):
        """The amortized encoder :math:`q(z \\mid x_R)`, computed from the ``x`` given and
        the mask of its ``hidden`` entries (booleans shaped like ``x``, ``True`` where
        hidden; ``None``: nothing is hidden)."""
        self._check_data(x)
        self._check_hidden(x, hidden)
        with self._plate(x) as idx:
            if hidden is not None:
                hidden = self._select(hidden.expand(x.shape), idx)
            loc, scale = self.encode(self._select(x, idx), hidden)
            pyro.sample("z", dist.Normal(loc, scale).to_event(1))

    @torch.no_grad()
    def sample(self, num_samples):
        """Draws ``num_samples`` observations from the model, shape ``(num_samples, D)``."""
        p = next(self.parameters())
        z = torch.randn(num_samples, self.latent_dim, dtype=p.dtype, device=p.device)
        return self.observation_dist(z).sample()

    def _init_noise(self, noise_scale, shape=()):
        if self.likelihood == "normal":
            self.noise_scale = PyroParam(
                torch.full(shape, float(noise_scale)), constraint=constraints.positive
            )


class LinearVAE(_AutoEncoderModel):
    """A VAE with a linear decoder and a linear amortized encoder:

    .. math::

        z_n \\sim \\mathcal{N}(0, I_K), \\qquad
        x_n \\mid z_n \\sim \\prod_{j=1}^{D} \\mathrm{Bernoulli}\\big(
            \\sigma(W z_n + b)_j\\big),

    and, with :math:`m_n \\in \\{0, 1\\}^D` the indicator of the entries of :math:`x_n` that
    are hidden and :math:`R` the visible ones,

    .. math::

        q(z_n \\mid x_{n,R}) = \\mathcal{N}\\big(A_x ((1 - m_n) \\odot x_n) + A_m m_n + c,
            \\mathrm{diag}(s)^2\\big),

    with :math:`A = [A_x, A_m]` (``encoder_weight``, shape ``(K, 2 D)``) and
    :math:`s = \\mathrm{softplus}(\\rho) + 10^{-4}` a learnable vector shared by all
    observations and masks. With nothing hidden (:math:`m_n = 0`, ordinary ``Trace_ELBO``
    training) this is :math:`\\mathcal{N}(A_x x_n + c, \\mathrm{diag}(s)^2)`. With
    ``likelihood="normal"`` the observations are
    :math:`\\mathcal{N}(W z_n + b, \\sigma^2 I_D)` with a learnable scalar :math:`\\sigma`,
    which is :class:`~pyro_mpt.models.PPCA` with a mean-field amortized guide.

    The data layout (``x`` of shape ``(N, D)``, ``z`` local in ``pyro.plate("data")``,
    broadcasting over outer plates) is in :mod:`pyro_mpt.models.vae`'s module notes.

    :param int num_features: ``D``.
    :param int latent_dim: ``K``.
    :param str likelihood: ``"bernoulli"`` (binary data) or ``"normal"``.
    :param float init_scale: standard deviation of the random initial ``W``.
    :param float noise_scale: initial ``sigma`` (``likelihood="normal"`` only).
    :param int subsample_size: optional mini-batch size for the data plate.

    .. note:: Parameters live in Pyro's global param store under their attribute names, so
        two instances share them; see the note on :class:`~pyro_mpt.models.PPCA`.

    Example::

        >>> vae = LinearVAE(num_features=6, latent_dim=2)
        >>> x = vae.sample(100)
        >>> x.shape
        torch.Size([100, 6])
    """

    def __init__(
        self,
        num_features,
        latent_dim=2,
        likelihood="bernoulli",
        init_scale=0.1,
        noise_scale=1.0,
        subsample_size=None,
    ):
        super().__init__()
        self._init_common(num_features, latent_dim, likelihood, subsample_size)
        D, K = self.num_features, self.latent_dim
        self.weight = PyroParam(init_scale * torch.randn(D, K))
        self.bias = PyroParam(torch.zeros(D))
        self._init_noise(noise_scale)
        # The encoder reads [x with hidden entries zeroed, hidden indicator]: 2 D inputs.
        self.encoder_weight = PyroParam(torch.zeros(K, 2 * D))
        self.encoder_bias = PyroParam(torch.zeros(K))
        # softplus(0.5413) = 1: the encoder starts at unit scale.
        self.encoder_scale_raw = PyroParam(torch.full((K,), 0.5413))
        check_stored_shapes(self)

    def decode(self, z):
        """Logits (Bernoulli) or means (normal) of ``x`` given ``z``: ``(..., K) -> (..., D)``."""
        return z @ self.weight.T + self.bias

    def encode(self, x, hidden=None):
        """``(loc, scale)`` of :math:`q(z \\mid x_R)`, each of shape ``(..., K)``, for ``x``
        of shape ``(..., D)`` whose entries are hidden where ``hidden`` is ``True``."""
        loc = self._encoder_input(x, hidden) @ self.encoder_weight.T + self.encoder_bias
        scale = F.softplus(self.encoder_scale_raw) + _MIN_SCALE
        return loc, scale.expand(loc.shape)


def _linear(in_dim, out_dim):
    """A linear layer whose weight and bias are :class:`~pyro.nn.PyroParam`: a ``PyroModule``
    takes those from Pyro's param store on every call, as it does ``PPCA``'s, so a VAE built
    after another of the same sizes, or after ``pyro.get_param_store().load(...)``, computes
    with the stored values that the optimiser updates. With plain ``nn.Parameter`` s it would
    compute with its own while ``SVI``'s optimiser updated the stored ones: no training."""
    layer = PyroModule[torch.nn.Linear](in_dim, out_dim)
    layer.weight = PyroParam(layer.weight.detach())
    layer.bias = PyroParam(layer.bias.detach())
    return layer


def _mlp(in_dim, hidden_dim, out_dim, num_layers, activation):
    layers = []
    for i in range(num_layers):
        layers += [_linear(in_dim if i == 0 else hidden_dim, hidden_dim)]
        layers += [torch.nn.Tanh() if activation == "tanh" else torch.nn.ReLU()]
    layers += [_linear(hidden_dim, out_dim)]
    return PyroModule[torch.nn.Sequential](*layers)


class VAE(_AutoEncoderModel):
    """A variational autoencoder (Kingma & Welling, 2014; Rezende et al., 2014) with MLP
    decoder and encoder:

    .. math::

        z_n \\sim \\mathcal{N}(0, I_K), \\qquad
        x_n \\mid z_n \\sim \\prod_{j=1}^{D} \\mathrm{Bernoulli}\\big(
            \\sigma(f_\\theta(z_n))_j\\big)
        \\quad\\text{or}\\quad \\mathcal{N}\\big(f_\\theta(z_n), \\mathrm{diag}(\\sigma^2)\\big),

    with :math:`q(z_n \\mid x_{n,R}) = \\mathcal{N}(\\mu_\\phi(u_n),
    \\mathrm{diag}(\\mathrm{softplus}(\\rho_\\phi(u_n)) + 10^{-4})^2)`, where the encoder's
    input :math:`u_n = [(1 - m_n) \\odot x_n, m_n]` is the data with its hidden entries set to
    0 and their indicator :math:`m_n` beside it (:math:`m_n = 0` when nothing is hidden).
    Decoder and encoder each have ``num_layers`` hidden layers of width ``hidden_dim``; the
    encoder reads ``2 D`` inputs.

    The data layout (``x`` of shape ``(N, D)``, ``z`` local in ``pyro.plate("data")``,
    broadcasting over outer plates) is in :mod:`pyro_mpt.models.vae`'s module notes.

    :param int num_features: ``D``.
    :param int latent_dim: ``K``.
    :param int hidden_dim: width of the hidden layers.
    :param str likelihood: ``"bernoulli"`` (binary data) or ``"normal"``.
    :param int num_layers: number of hidden layers in decoder and encoder (at least 1).
    :param str activation: ``"tanh"`` or ``"relu"``.
    :param str noise: ``"scalar"`` (one ``sigma``) or ``"feature"`` (one per feature);
        ``likelihood="normal"`` only.
    :param float noise_scale: initial ``sigma`` (``likelihood="normal"`` only).
    :param int subsample_size: optional mini-batch size for the data plate.

    .. note:: Parameters live in Pyro's global param store under their attribute names, so
        two instances share them; see the note on :class:`~pyro_mpt.models.PPCA`.

    Example::

        >>> vae = VAE(num_features=784, latent_dim=10, hidden_dim=256)
        >>> vae.encode(torch.zeros(3, 784))[0].shape
        torch.Size([3, 10])
    """

    def __init__(
        self,
        num_features,
        latent_dim=10,
        hidden_dim=256,
        likelihood="bernoulli",
        num_layers=1,
        activation="tanh",
        noise="scalar",
        noise_scale=1.0,
        subsample_size=None,
    ):
        super().__init__()
        self._init_common(num_features, latent_dim, likelihood, subsample_size)
        hidden_dim = check_positive_int("hidden_dim", hidden_dim)
        num_layers = check_positive_int("num_layers", num_layers)
        if activation not in ("tanh", "relu"):
            raise ValueError(f"activation must be 'tanh' or 'relu', got {activation!r}.")
        if noise not in ("scalar", "feature"):
            raise ValueError(f"noise must be 'scalar' or 'feature', got {noise!r}.")
        self.hidden_dim = hidden_dim
        self.num_layers = num_layers
        D, K = self.num_features, self.latent_dim
        self.decoder = _mlp(K, hidden_dim, D, num_layers, activation)
        self.encoder = _mlp(2 * D, hidden_dim, 2 * K, num_layers, activation)
        self._init_noise(noise_scale, () if noise == "scalar" else (D,))
        check_stored_shapes(self)

    def decode(self, z):
        """Logits (Bernoulli) or means (normal) of ``x`` given ``z``: ``(..., K) -> (..., D)``."""
        return self.decoder(z)

    def encode(self, x, hidden=None):
        """``(loc, scale)`` of :math:`q(z \\mid x_R)`, each of shape ``(..., K)``, for ``x``
        of shape ``(..., D)`` whose entries are hidden where ``hidden`` is ``True``."""
        loc, raw = self.encoder(self._encoder_input(x, hidden)).split(self.latent_dim, dim=-1)
        return loc, F.softplus(raw) + _MIN_SCALE
