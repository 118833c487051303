"""The antibody sequences of the AntiBERTy reproductions (``bert-curve``, ``mlm-generation``):
the model's label and the order in which they take the sequences."""

__all__ = ["ANTIBERTY", "alternating_chains"]

#: The ``model`` entry of the AntiBERTy reproductions' configs.
ANTIBERTY = "AntiBERTy_md_smooth (antiberty 0.1.3)"


def alternating_chains():
    """The names of :data:`~pyro_mpt.transformers.antiberty.ANTIBODY_SEQUENCES`, heavy and
    light chains alternating, so that the first few hold both kinds."""
    from pyro_mpt.transformers.antiberty import ANTIBODY_SEQUENCES

    heavy = [n for n in ANTIBODY_SEQUENCES if n.endswith("_vh")]
    light = [n for n in ANTIBODY_SEQUENCES if n.endswith("_vl")]
    return [n for pair in zip(heavy, light) for n in pair]
