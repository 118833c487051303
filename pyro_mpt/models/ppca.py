"""Probabilistic PCA and factor analysis as Pyro modules."""

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints
from pyro.nn import PyroModule, PyroParam, pyro_method

from pyro_mpt.models._data import check_data_dtype
from pyro_mpt.models._param_store import check_stored_shapes

__all__ = ["PPCA", "FactorAnalysis"]


class PPCA(PyroModule):
    """Probabilistic PCA (Tipping & Bishop, 1999):

    .. math::

        z_n \\sim \\mathcal{N}(0, I_K), \\qquad
        x_n \\mid z_n \\sim \\mathcal{N}(W z_n + \\mu, \\sigma^2 I_D),

    so that :math:`p(x_n) = \\mathcal{N}(\\mu, W W^\\top + \\sigma^2 I)`. ``W``, ``mu`` and
    ``sigma`` are learnable parameters; ``z`` is a local latent inside the ``"data"`` plate,
    so :class:`~pyro_mpt.MPTLoss` integrates it out exactly.

    :meth:`guide` is an amortized Gaussian encoder
    :math:`q(z \\mid x) = \\mathcal{N}(A (x - \\mu) + c, \\Sigma_q)` for ``Trace_ELBO``
    baselines. With ``guide_covariance="full"`` the family contains the exact posterior, so
    the ELBO can reach the log-marginal likelihood; ``"diagonal"`` is mean-field.

    :param int num_features: ``D``.
    :param int latent_dim: ``K``.
    :param float init_scale: standard deviation of the random initial ``W``.
    :param float noise_scale: initial ``sigma``.
    :param str guide_covariance: ``"full"`` or ``"diagonal"``.
    :param int subsample_size: optional mini-batch size for the data plate.

    .. note:: Like every ``PyroModule``, its parameters live in Pyro's global param store
        under their attribute names, so two instances share them: one built after another
        (or after ``pyro.get_param_store().load(...)``) starts from the stored values and
        trains them, and one whose names are stored with other shapes is refused as it is
        built. To train several models side by side call
        ``pyro.settings.set(module_local_params=True)`` first, or ``pyro.clear_param_store()``
        between them. The same holds for every model of :mod:`pyro_mpt.models`.

    Example::

        >>> ppca = PPCA(num_features=5, latent_dim=2)
        >>> x = ppca.sample(100)
        >>> x.shape
        torch.Size([100, 5])
    """

    def __init__(
        self,
        num_features,
        latent_dim,
        init_scale=0.1,
        noise_scale=1.0,
        guide_covariance="full",
        subsample_size=None,
    ):
        super().__init__()
        if guide_covariance not in ("full", "diagonal"):
            raise ValueError(
                f"guide_covariance must be 'full' or 'diagonal', got {guide_covariance!r}."
            )
        self.num_features = int(num_features)
        self.latent_dim = int(latent_dim)
        self.subsample_size = subsample_size
        self.guide_covariance = guide_covariance
        self.weight = PyroParam(init_scale * torch.randn(num_features, latent_dim))
        self.loc = PyroParam(torch.zeros(num_features))
        self._init_noise(noise_scale)
        # Guide parameters.
        self.encoder_weight = PyroParam(torch.zeros(latent_dim, num_features))
        self.encoder_bias = PyroParam(torch.zeros(latent_dim))
        if guide_covariance == "full":
            self.encoder_scale_tril = PyroParam(
                torch.eye(latent_dim), constraint=constraints.lower_cholesky
            )
        else:
            self.encoder_scale = PyroParam(torch.ones(latent_dim), constraint=constraints.positive)
        check_stored_shapes(self)

    def _init_noise(self, noise_scale):
        self.noise_scale = PyroParam(
            torch.tensor(float(noise_scale)), constraint=constraints.positive
        )

    def _noise(self):
        return self.noise_scale

    def _plate(self, x):
        return pyro.plate("data", x.shape[-2], subsample_size=self.subsample_size, dim=-1)

    @pyro_method
    def model(self, x):
        """The generative model; ``x`` has shape ``(N, D)`` (extra leading dims broadcast)."""
        check_data_dtype(x, self)
        with self._plate(x) as idx:
            z = pyro.sample(
                "z",
                dist.Normal(x.new_zeros(self.latent_dim), x.new_ones(())).to_event(1),
            )
            loc = z @ self.weight.T + self.loc
            pyro.sample(
                "x", dist.Normal(loc, self._noise()).to_event(1), obs=x.index_select(-2, idx)
            )

    @pyro_method
    def guide(self, x):
        """An amortized Gaussian encoder for ``z`` (used by ``Trace_ELBO``)."""
        check_data_dtype(x, self)
        with self._plate(x) as idx:
            loc = (x.index_select(-2, idx) - self.loc) @ self.encoder_weight.T + self.encoder_bias
            if self.guide_covariance == "full":
                q = dist.MultivariateNormal(loc, scale_tril=self.encoder_scale_tril)
            else:
                q = dist.Normal(loc, self.encoder_scale).to_event(1)
            pyro.sample("z", q)

    def covariance(self):
        """The marginal covariance ``W W^T + diag(noise variances)``, shape ``(D, D)``."""
        noise_var = self._noise().expand(self.num_features) ** 2
        return self.weight @ self.weight.T + torch.diag(noise_var)

    @torch.no_grad()
    def sample(self, num_samples):
        """Draws ``num_samples`` observations from the model, shape ``(num_samples, D)``."""
        like = dict(dtype=self.weight.dtype, device=self.weight.device)
        z = torch.randn(num_samples, self.latent_dim, **like)
        noise = torch.randn(num_samples, self.num_features, **like)
        return z @ self.weight.T + self.loc + noise * self._noise()


class FactorAnalysis(PPCA):
    """Factor analysis: PPCA with a separate noise scale per feature,
    :math:`x_n \\mid z_n \\sim \\mathcal{N}(W z_n + \\mu, \\mathrm{diag}(\\psi))`.

    Takes the same arguments as :class:`PPCA`.
    """

    def _init_noise(self, noise_scale):
        self.noise_scale = PyroParam(
            torch.full((self.num_features,), float(noise_scale)), constraint=constraints.positive
        )
