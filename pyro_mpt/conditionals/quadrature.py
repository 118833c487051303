"""Self-predictive conditionals by numerical integration over a low-dimensional latent."""

import functools
import math
import numbers
import os

import torch

from pyro_mpt.conditionals.base import Conditionals
from pyro_mpt.conditionals.quadrature_self_predictive import quadrature_self_predictive
from pyro_mpt.errors import NotApplicableError, check_positive_int
from pyro_mpt.ops.quadrature_nodes import adapted_nodes, gauss_hermite_grid
from pyro_mpt.trace.guide_centres import whitened_guide
from pyro_mpt.trace.remembered_structure import RememberedStructure
from pyro_mpt.trace.trace_utils import unwrap_independent
from pyro_mpt.trace.whitened_latents import run_at_points

__all__ = ["MAX_POINTS", "MEMORY_FRACTION", "Quadrature"]


#: The most nodes per dimension: Gauss-Hermite weights underflow beyond a few hundred.
MAX_POINTS = 200
#: The share of the memory available on the device that a run evaluating the likelihood of
#: every observation at every node may need, by the estimate, unless ``max_memory_gb`` says.
MEMORY_FRACTION = 0.5
#: ``(G, N, D)`` tensors such a run holds at once, at least: the likelihood's parameters,
#: the log-likelihoods, and the gradients of both.
_PER_OBSERVATION_TENSORS = 4


class Quadrature(Conditionals):
    """Conditionals by Gauss–Hermite quadrature over the local latents.

    The model runs once with its latents at every node of a tensor-product Gauss–Hermite
    rule for their Gaussian prior (``num_points ** K`` nodes in whitened coordinates), and
    the per-feature log-likelihoods at the nodes serve every mask:

    .. math::

        p(x_j \\mid x_R) = \\frac{\\sum_g w_g\\, p(x_j \\mid z_g)
            \\prod_{k \\in R} p(x_k \\mid z_g)}{\\sum_g w_g \\prod_{k \\in R} p(x_k \\mid z_g)}.

    Any likelihood that factorises over features works (Bernoulli, Normal, Poisson,
    Categorical, ...): the observed site must be a distribution over single features, made
    an event with ``.to_event`` or placed in a feature plate.

    With nodes under the prior, a ``Bernoulli``, ``Geometric`` or ``Poisson`` likelihood
    whose parameters depend on the observation only through ``z`` (a decoder), and data
    with at most 16 distinct values (binary pixels, small counts), the log-likelihoods are
    tabulated over those values, ``(V, D, G)``, and every sum becomes a matrix product: no
    ``(G, N, D)`` tensor, in time or memory. Other cases evaluate the likelihood of every
    observation at every node.

    Each call runs the model once at the nodes, with every latent drawn through its own
    prior at the nodes of the whitened space (:mod:`pyro_mpt.trace.whitened_latents`), so
    hierarchical latents are integrated right; the first call with a model (and argument
    shapes) also traces it once to read its structure. A prior whose parameters are the same
    for every observation keeps its nodes shared whether it is broadcast along the data
    plate (``Normal(torch.zeros(K), 1)``) or materialised with equal rows
    (``Normal(x.new_zeros(N, K), x.new_ones(N, K))``); the rows are compared on every call.

    A run that evaluates the likelihood of every observation at every node (a prior or
    likelihood parameters that differ per observation, or ``center="guide"``) is estimated
    first, at ``4 G N D`` numbers of the data's dtype, and refused with a
    :class:`~pyro_mpt.errors.NotApplicableError` naming the estimate and the fix when it
    exceeds ``max_memory_gb`` (``conditionals="auto"`` then moves on to importance sampling).

    :param int num_points: nodes per latent dimension.
    :param int max_latent_dim: the largest total latent dimension ``K`` accepted
        (``num_points ** K`` nodes; the default 3).
    :param str center: where the nodes go. ``"prior"`` places them under the latent prior.
        ``"guide"`` centres and scales them per observation at the guide's ``q(z | x)``
        (the weights absorb the density ratio, so the rule still integrates against the
        prior): far more accurate for ``log p(x)`` when the posterior is much narrower than
        the prior, as for images with hundreds of pixels. The nodes are placed for the full
        data, so the conditionals of heavily masked inputs, whose posterior is broader, can
        fall outside them: ``conditionals="auto"`` never picks this rule. Needs ``Normal``
        priors and a guide with ``Normal`` latents; no gradient flows into the guide.
    :param float max_memory_gb: the most memory, in GB (``1e9`` bytes), that a run evaluating
        the likelihood of every observation at every node may need by the estimate; ``None``
        (the default): :data:`MEMORY_FRACTION` of the memory available on the data's device
        when the run starts.

    .. note:: Latents must have ``Normal``, ``MultivariateNormal`` or transformed-normal
        (e.g. ``LogNormal``) priors, possibly depending on other latents, and sit inside
        the data plate. For larger latents use ``conditionals="importance"``.

    Example::

        >>> from pyro_mpt import MPTLoss
        >>> from pyro_mpt.conditionals import Quadrature
        >>> loss = MPTLoss(rate="uniform", conditionals=Quadrature(num_points=20))
    """

    name = "quadrature"

    def __init__(self, num_points=20, max_latent_dim=3, center="prior", max_memory_gb=None):
        self._structure = RememberedStructure()
        num_points = check_positive_int("num_points", num_points, "e.g. num_points=20.")
        if num_points > MAX_POINTS:
            raise ValueError(
                f"num_points={num_points} is more than {MAX_POINTS}, past which Gauss-Hermite "
                f"weights underflow; use at most {MAX_POINTS}, or importance sampling."
            )
        if center not in ("prior", "guide"):
            raise ValueError(
                f"center must be 'prior' or 'guide', got {center!r}: 'prior' places the nodes "
                f"under the latents' prior, 'guide' at the guide's q(z | x)."
            )
        if max_memory_gb is not None and (
            isinstance(max_memory_gb, bool)
            or not isinstance(max_memory_gb, numbers.Real)
            or not max_memory_gb > 0
        ):
            raise ValueError(
                f"max_memory_gb must be a positive number of GB or None (a share of the "
                f"available memory), got {max_memory_gb!r}; e.g. max_memory_gb=8."
            )
        self.num_points = int(num_points)
        self.max_latent_dim = int(max_latent_dim)
        self.center = center
        self.max_memory_gb = None if max_memory_gb is None else float(max_memory_gb)
        # The rule's nodes and log-weights in the dtypes and on the devices used so far.
        self._grids = {}

    def __repr__(self):
        return f"Quadrature(num_points={self.num_points}, center={self.center!r})"

    @property
    def guide_loss(self):
        """Nodes at the guide need a guide fitted to the posterior: ``"elbo"`` trains it."""
        return "elbo" if self.center == "guide" else None

    def prepare(self, model, guide, args, kwargs, max_plate_nesting=math.inf, signature=None):
        """See :meth:`Conditionals.prepare`.

        :param signature: the call's :func:`~pyro_mpt.trace.remembered_structure.call_signature`
            when the caller has it already (worked out here otherwise).
        """
        call = (model, guide, args, kwargs, max_plate_nesting, signature)
        return self._structure.prepared(self, *call)

    def refinement_gap(self, prepared, model, guide, args, kwargs, structure=None, factor=1.5):
        """The mean change of ``log p(x)`` per observation when the rule is refined to 1.5
        times its nodes per dimension (the test ``conditionals="auto"`` chose it by), on the
        data of ``prepared``'s call; NaN when no finer rule fits (more than
        :data:`MAX_POINTS` nodes per dimension, or more memory than allowed). The
        finer rule is prepared from the random state the caller leaves, so a subsampled model
        must be given the state ``prepared`` was made from. ``factor`` below 1 compares
        with a coarser rule instead (``factor`` times the nodes, at least one): for a rule
        at the limit, a sign that it is still moving, not a measure of its own error."""
        num_points = max(1, math.ceil(factor * self.num_points))
        if num_points > MAX_POINTS:
            return math.nan
        finer = Quadrature(
            num_points=num_points,
            max_latent_dim=self.max_latent_dim,
            center=self.center,
            max_memory_gb=self.max_memory_gb,
        )
        try:
            with torch.no_grad():
                if structure is None:
                    finer_prepared = finer.prepare(model, guide, args, kwargs)
                else:
                    finer_prepared = finer.prepare_with(structure, model, guide, args, kwargs)
                change = finer_prepared.log_marginal() - prepared.log_marginal()
        except NotApplicableError:
            return math.nan
        return float(change.abs().mean())

    def structure_for(self, signature):
        """The structure :meth:`prepare` read for calls of ``signature`` (the very object it
        was passed), or None: a caller that holds it calls :meth:`prepare_with`."""
        return self._structure.held(signature)

    def prepare_with(self, structure, model, guide, args, kwargs):
        """:meth:`prepare` for a call like the one ``structure`` was read from (the same
        model and argument shapes): the model runs once, at the nodes."""
        observed = structure.observed
        if not structure.latents:
            raise NotApplicableError(
                "quadrature integrates over local latents and the model has none."
            )
        base = unwrap_independent(structure.trace.nodes[observed.name]["fn"])
        if base.event_shape:
            raise NotApplicableError(
                f"Observed site {observed.name!r} has a {type(base).__name__} likelihood "
                f"that does not factorise over features; quadrature needs one distribution per "
                f"feature (e.g. Bernoulli(...).to_event(1))."
            )
        latent_dim = structure.latent_dim
        if latent_dim > self.max_latent_dim:
            raise NotApplicableError(
                f"quadrature integrates over at most {self.max_latent_dim} latent dimensions "
                f"({self.num_points}**K nodes) and the latent sites "
                f"{list(structure.latent_names)} have K={latent_dim}. Use "
                f"conditionals='importance' for larger latents."
            )
        # Nodes follow the latents' dtype: observations may be integers (counts, classes).
        first = structure.trace.nodes[structure.latents[0].name]["value"]
        grid_key = (latent_dim, first.dtype, first.device)
        grid = self._grids.get(grid_key)
        if grid is None:  # once per latent dimension, dtype and device
            grid = gauss_hermite_grid(self.num_points, *grid_key)
            self._grids[grid_key] = grid
        nodes, log_weights = grid
        if self.center == "guide":
            if guide is None:
                raise NotApplicableError("quadrature with center='guide' needs a guide.")
            center, scale = whitened_guide(model, guide, args, kwargs, structure)
            nodes, log_weights = adapted_nodes(nodes, log_weights, center, scale)
        memory_check = self._memory_check(structure, latent_dim)
        run = run_at_points(model, args, kwargs, structure, nodes, memory_check)
        # Draws run the model again at the nodes they pick, with the structure read here.
        run_at = functools.partial(run_at_points, model, args, kwargs, structure)
        # Nodes: whitened points (G, K), or (G,) + batch + (K,) at the guide.
        return quadrature_self_predictive(run, log_weights, nodes, run_at, memory_check)

    def _memory_check(self, structure, latent_dim):
        """A check, ``check(num_nodes, dtype)``, that raises before a run evaluates the
        likelihood of every observation at ``num_nodes`` nodes when its estimated memory is
        above the limit."""
        observed = structure.observed
        num_obs, num_features = math.prod(observed.batch_shape), observed.num_features
        device = observed.value.device

        def check(num_nodes, dtype):
            per_node = num_obs * num_features * dtype.itemsize * _PER_OBSERVATION_TENSORS
            needed = num_nodes * per_node
            if self.max_memory_gb is not None:
                limit, source = self.max_memory_gb * 1e9, f"max_memory_gb={self.max_memory_gb:g}"
            else:
                available = _available_memory(device)
                if available is None:
                    return
                limit = MEMORY_FRACTION * available
                source = (
                    f"{MEMORY_FRACTION:g} of the {available / 1e9:.1f} GB available on "
                    f"{device.type}, MEMORY_FRACTION"
                )
            if needed <= limit:
                return
            fits = math.floor((limit / per_node) ** (1 / latent_dim) + 1e-9)
            fewer = (
                f"fewer nodes (num_points={min(fits, self.num_points - 1)} fits this batch)"
                if fits >= 2
                else "fewer nodes"
            )
            raise NotApplicableError(
                f"{self!r} would evaluate the likelihood of each of the {num_obs} observations "
                f"at each of its {num_nodes} nodes (num_points={self.num_points}, K="
                f"{latent_dim}), because the latents' prior or the likelihood's parameters "
                f"differ between observations (or center='guide'). That needs an estimated "
                f"{needed / 1e9:.3g} GB ({num_nodes} nodes x {num_obs} observations x "
                f"{num_features} features x {dtype.itemsize} bytes x "
                f"{_PER_OBSERVATION_TENSORS} tensors), above the limit of {limit / 1e9:.3g} "
                f"GB ({source}). Use {fewer}, a smaller batch, or conditionals='importance'; "
                f"or raise max_memory_gb if the memory is there."
            )

        return check


def _available_memory(device):
    """Bytes of memory available for new tensors on ``device``: free GPU memory plus what
    PyTorch's allocator holds unused, or the host's available memory (Linux); ``None``
    where it cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
