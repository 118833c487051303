"""Hand-written Pyro models with exact or independent references, shared by the tests and the
benchmarks (neither imports the other):

* :mod:`experiments.zoo.models`: the model zoo (``ZOO``), each factory a
  :class:`~experiments.zoo.models.ZooCase` with an exact ``log p(x_i)`` or the error every
  strategy must raise (``tests/test_model_zoo.py``, ``benchmarks/model_zoo_table.py``);
* :mod:`experiments.zoo.deep_models`: models beyond quadrature's reach with independent
  references (``tests/test_models_beyond_quadrature.py``,
  ``benchmarks/beyond_quadrature_table.py``);
* :mod:`experiments.zoo.cases`: the case record, seeded draws, grid references and the
  statistical checks;
* :mod:`experiments.zoo.references`: closed-form and grid references in float64.
"""
