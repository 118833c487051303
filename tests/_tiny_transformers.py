"""Tiny randomly initialised transformers built from configs (nothing downloaded), and the
letter vocabularies the tests tokenise with.

Imported by the test modules and by ``tests/_ddp_mpt_script.py``, which runs under
``torchrun`` with the repository root on ``PYTHONPATH``.
"""

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402

#: The special tokens of every test vocabulary, ids 0 to 4.
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_vocab(folder, letters):
    """A WordPiece vocabulary of the special tokens and ``letters``, written to
    ``folder/vocab.txt``; returns the folder (a string) for ``from_pretrained``."""
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "vocab.txt"), "w", encoding="utf-8") as handle:
        handle.write("\n".join(SPECIAL + list(letters)) + "\n")
    return folder


def letter_tokenizer(folder, letters):
    """A ``BertTokenizer`` over the special tokens and ``letters`` (one token per letter),
    its vocabulary written to ``folder``."""
    return transformers.BertTokenizer.from_pretrained(
        write_vocab(folder, letters), do_lower_case=False
    )


def _width(width):
    """Hidden and feed-forward sizes of a tiny model ``width`` wide, with two heads."""
    return dict(hidden_size=width, num_attention_heads=2, intermediate_size=2 * width)


def tiny_bert(vocab_size, seed=0, width=16, dropout=0.1, **config):
    """A ``BertForMaskedLM`` initialised under ``torch.manual_seed(seed)``: one layer
    ``width`` wide (two heads, feed-forward ``2 width``), 32 positions, ``dropout`` on the
    hidden states and the attention probabilities (BERT's 0.1 unless given), unless
    ``config`` (``BertConfig`` fields) says otherwise."""
    settings = dict(vocab_size=vocab_size, num_hidden_layers=1, max_position_embeddings=32)
    settings.update(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    settings.update(_width(width), **config)
    torch.manual_seed(seed)
    return transformers.BertForMaskedLM(transformers.BertConfig(**settings))


def tiny_vit_mae(image_size=8, patch_size=2, seed=0, **config):
    """A ViT-MAE for one-channel images (``vit_mae_from_config``) initialised under
    ``torch.manual_seed(seed)``: encoder and decoder of one layer of width 16 and two heads,
    unless ``config`` (``ViTMAEConfig`` fields) says otherwise."""
    from pyro_mpt.transformers.vit_mae import vit_mae_from_config

    decoder = {f"decoder_{key}": value for key, value in _width(16).items()}
    settings = dict(image_size=image_size, patch_size=patch_size, num_channels=1)
    settings.update(_width(16), num_hidden_layers=1, decoder_num_hidden_layers=1, **decoder)
    settings.update(config)
    torch.manual_seed(seed)
    return vit_mae_from_config(transformers.ViTMAEConfig(**settings))
