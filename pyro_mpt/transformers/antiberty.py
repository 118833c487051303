"""The pre-trained antibody language model AntiBERTy (Ruffolo et al., 2021), loaded offline
from the files of the PyPI package ``antiberty`` as a plain
:class:`transformers.BertForMaskedLM`, with its tokenizer and a few dozen real antibody
variable-domain sequences to score.

The package ships an 8-layer BERT (hidden size 512, 26M parameters) trained by masked
language modelling on about 558M antibody sequences of the Observed Antibody Space, with a
25-token vocabulary: ``[PAD] [UNK] [CLS] [SEP] [MASK]`` and the 20 amino acids. Its
checkpoint holds the masked-LM head under the names of ``BertForMaskedLM`` (its extra
species and chain heads are dropped on loading). Install it without its pinned
dependencies::

    pip install --no-deps antiberty==0.1.3
"""

import importlib.util
import os

import torch

__all__ = [
    "ANTIBODY_SEQUENCES",
    "antiberty_dir",
    "load_antiberty",
    "load_antiberty_tokenizer",
    "random_antiberty",
    "spaced",
]

#: Variable domains (VH and VL) of approved therapeutic antibodies, 16 heavy and 16 light
#: chains, as published amino-acid sequences; their lengths agree with the published ones,
#: but they have not been checked residue by residue against the INN records.
#: They are real antibodies, of human, humanised and chimeric origin, none of which needs to
#: be in AntiBERTy's training set (natural repertoires of the Observed Antibody Space).
ANTIBODY_SEQUENCES = {
    "trastuzumab_vh": "EVQLVESGGGLVQPGGSLRLSCAASGFNIKDTYIHWVRQAPGKGLEWVARIYPTNGYTRYADSVKGRFTISADT"
    "SKNTAYLQMNSLRAEDTAVYYCSRWGGDGFYAMDYWGQGTLVTVSS",
    "adalimumab_vh": "EVQLVESGGGLVQPGRSLRLSCAASGFTFDDYAMHWVRQAPGKGLEWVSAITWNSGHIDYADSVEGRFTISRDN"
    "AKNSLYLQMNSLRAEDTAVYYCAKVSYLSTASSLDYWGQGTLVTVSS",
    "pembrolizumab_vh": "QVQLVQSGVEVKKPGASVKVSCKASGYTFTNYYMYWVRQAPGQGLEWMGGINPSNGGTNFNEKFKNRVTLTTD"
    "SSTTTAYMELKSLQFDDTAVYYCARRDYRFDMGFDYWGQGTTVTVSS",
    "nivolumab_vh": "QVQLVESGGGVVQPGRSLRLDCKASGITFSNSGMHWVRQAPGKGLEWVAVIWYDGSKRYYADSVKGRFTISRDNS"
    "KNTLFLQMNSLRAEDTAVYYCATNDDYWGQGTLVTVSS",
    "mirikizumab_vh": "QVQLVQSGAEVKKPGSSVKVSCKASGYKFTRYVMHWVRQAPGQGLEWMGYINPYNDGTNYNEKFKGRVTITADK"
    "STSTAYMELSSLRSEDTAVYYCARNWDTGLWGQGTTVTVSS",
    "natalizumab_vh": "QVQLVQSGAEVKKPGASVKVSCKASGFNIKDTYIHWVRQAPGQRLEWMGRIDPANGYTKYDPKFQGRVTITADT"
    "SASTAYMELSSLRSEDTAVYYCAREGYYGNYGVYAMDYWGQGTLVTVSS",
    "necitumumab_vh": "QVQLQESGPGLVKPSQTLSLTCTVSGGSISSGDYYWSWIRQPPGKGLEWIGYIYYSGSTDYNPSLKSRVTMSVD"
    "TSKNQFSLKVNSVTAADTAVYYCARVSIFGVGTFDYWGQGTLVTVSS",
    "nirsevimab_vh": "QVQLVQSGAEVKKPGSSVMVSCQASGGLLEDYIINWVRQAPGQGPEWMGGIIPVLGTVHYGPKFQGRVTITADE"
    "STDTAYMELSSLRSEDTAMYYCATETALVVSETYLPHYFDNWGQGTLVTVSS",
    "obinutuzumab_vh": "QVQLVQSGAEVKKPGSSVKVSCKASGYAFSYSWINWVRQAPGQGLEWMGRIFPGDGDTDYNGKFKGRVTITADK"
    "STSTAYMELSSLRSEDTAVYYCARNVFDGYWLVYWGQGTLVTVSS",
    "ocrelizumab_vh": "EVQLVESGGGLVQPGGSLRLSCAASGYTFTSYNMHWVRQAPGKGLEWVGAIYPGNGDTSYNQKFKGRFTISVDK"
    "SKNTLYLQMNSLRAEDTAVYYCARVVYYSNSYWYFDVWGQGTLVTVSS",
    "ofatumumab_vh": "EVQLVESGGGLVQPGRSLRLSCAASGFTFNDYAMHWVRQAPGKGLEWVSTISWNSGSIGYADSVKGRFTISRDN"
    "AKKSLYLQMNSLRAEDTALYYCAKDIQYGNYYYGMDVWGQGTTVTVSS",
    "palivizumab_vh": "QVTLRESGPALVKPTQTLTLTCTFSGFSLSTSGMSVGWIRQPPGKALEWLADIWWDDKKDYNPSLKSRLTISKD"
    "TSKNQVVLKVTNMDPADTATYYCARSMITNWYFDVWGAGTTVTVSS",
    "panitumumab_vh": "QVQLQESGPGLVKPSETLSLTCTVSGGSVSSGDYYWTWIRQSPGKGLEWIGHIYYSGNTNYNPSLKSRLTISID"
    "TSKTQFSLKLSSVTAADTAIYYCVRDRVTGAFDIWGQGTMVTVSS",
    "ramucirumab_vh": "EVQLVQSGGGLVKPGGSLRLSCAASGFTFSSYSMNWVRQAPGKGLEWVSSISSSSSYIYYADSVKGRFTISRDN"
    "AKNSLYLQMNSLRAEDTAVYYCARVTDAFDIWGQGTMVTVSS",
    "secukinumab_vh": "EVQLVESGGGLVQPGGSLRLSCAASGFTFSNYWMNWVRQAPGKGLEWVAAINQDGSEKYYVGSVKGRFTISRDN"
    "AKNSLYLQMNSLRVEDTAVYYCVRDYYDILTDYYIHYWYFDLWGRGTLVTVSS",
    "sotrovimab_vh": "QVQLVQSGAEVKKPGASVKVSCKASGYPFTSYGISWVRQAPGQGLEWMGWISTYQGNTNYAQKFQGRVTMTTDT"
    "STTTGYMELRRLRSDDTAVYYCARDYTRGAWFGESLIGGFDNWGQGTLVTVSS",
    "trastuzumab_vl": "DIQMTQSPSSLSASVGDRVTITCRASQDVNTAVAWYQQKPGKAPKLLIYSASFLYSGVPSRFSGSRSGTDFTLT"
    "ISSLQPEDFATYYCQQHYTTPPTFGQGTKVEIK",
    "adalimumab_vl": "DIQMTQSPSSLSASVGDRVTITCRASQGIRNYLAWYQQKPGKAPKLLIYAASTLQSGVPSRFSGSGSGTDFTLTI"
    "SSLQPEDVATYYCQRYNRAPYTFGQGTKVEIK",
    "pembrolizumab_vl": "EIVLTQSPATLSLSPGERATLSCRASKGVSTSGYSYLHWYQQKPGQAPRLLIYLASYLESGVPARFSGSGSGTD"
    "FTLTISSLEPEDFAVYYCQHSRDLPLTFGGGTKVEIK",
    "nivolumab_vl": "EIVLTQSPATLSLSPGERATLSCRASQSVSSYLAWYQQKPGQAPRLLIYDASNRATGIPARFSGSGSGTDFTLTIS"
    "SLEPEDFAVYYCQQSSNWPRTFGQGTKVEIK",
    "mepolizumab_vl": "DIVMTQSPDSLAVSLGERATINCKSSQSLLNSGNQKNYLAWYQQKPGQPPKLLIYGASTRESGVPDRFSGSGSGT"
    "DFTLTISSLQAEDVAVYYCQNVHSFPFTFGGGTKLEIK",
    "mirikizumab_vl": "DIQMTQSPSSLSASVGDRVTITCKASDHILKFLTWYQQKPGKAPKLLIYGATSLETGVPSRFSGSGSGTDFTLTI"
    "SSLQPEDFATYYCQMYWSTPFTFGGGTKVEIK",
    "natalizumab_vl": "DIQMTQSPSSLSASVGDRVTITCKTSQDINKYMAWYQQTPGKAPRLLIHYTSALQPGIPSRFSGSGSGRDYTFTI"
    "SSLQPEDIATYYCLQYDNLWTFGQGTKVEIK",
    "necitumumab_vl": "EIVMTQSPATLSLSPGERATLSCRASQSVSSYLAWYQQKPGQAPRLLIYDASNRATGIPARFSGSGSGTDFTLTI"
    "SSLEPEDFAVYYCHQYGSTPLTFGGGTKAEIK",
    "nirsevimab_vl": "DIQMTQSPSSLSAAVGDRVTITCQASQDIVNYLNWYQQKPGKAPKLLIYVASNLETGVPSRFSGSGSGTDFSLTIS"
    "SLQPEDVATYYCQQYDNLPLTFGGGTKVEIK",
    "obinutuzumab_vl": "DIVMTQTPLSLPVTPGEPASISCRSSKSLLHSNGITYLYWYLQKPGQSPQLLIYQMSNLVSGVPDRFSGSGSGTD"
    "FTLKISRVEAEDVGVYYCAQNLELPYTFGGGTKVEIK",
    "ocrelizumab_vl": "DIQMTQSPSSLSASVGDRVTITCRASSSVSYMHWYQQKPGKAPKPLIYAPSNLASGVPSRFSGSGSGTDFTLTISS"
    "LQPEDFATYYCQQWSFNPPTFGQGTKVEIK",
    "omalizumab_vl": "DIQLTQSPSSLSASVGDRVTITCRASQSVDYDGDSYMNWYQQKPGKAPKLLIYAASYLESGVPSRFSGSGSGTDFT"
    "LTISSLQPEDFATYYCQQSHEDPYTFGQGTKVEIK",
    "palivizumab_vl": "DIQMTQSPSTLSASVGDRVTITCKCQLSVGYMHWYQQKPGKAPKLLIYDTSKLASGVPSRFSGSGSGTEFTLTISS"
    "LQPDDFATYYCFQGSGYPFTFGGGTKLEIK",
    "panitumumab_vl": "DIQMTQSPSSLSASVGDRVTITCQASQDISNYLNWYQQKPGKAPKLLIYDASNLETGVPSRFSGSGSGTDFTFTI"
    "SSLQPEDIATYFCQHFDHLPLAFGGGTKVEIK",
    "pertuzumab_vl": "DIQMTQSPSSLSASVGDRVTITCKASQDVSIGVAWYQQKPGKAPKLLIYSASYRYTGVPSRFSGSGSGTDFTLTIS"
    "SLQPEDFATYYCQQYYIYPYTFGQGTKVEIK",
    "ramucirumab_vl": "DIQMTQSPSSVSASIGDRVTITCRASQGIDNWLGWYQQKPGKAPKLLIYDASNLDTGVPSRFSGSGSGTYFTLTIS"
    "SLQAEDFAVYFCQQAKAFPPTFGGGTKVDIK",
}


def antiberty_dir():
    """The folder ``antiberty/trained_models`` of the installed package.

    :raises ImportError: when ``antiberty`` is not installed, with the install command.
    """
    spec = importlib.util.find_spec("antiberty")
    if spec is None or spec.origin is None:
        raise ImportError(
            "the pre-trained antibody model needs the package 'antiberty' (its weights ship "
            "with it); install it with: pip install --no-deps antiberty==0.1.3"
        )
    path = os.path.join(os.path.dirname(spec.origin), "trained_models")
    if not os.path.isfile(os.path.join(path, "AntiBERTy_md_smooth", "config.json")):
        raise ImportError(f"the antiberty package at {path} lacks AntiBERTy_md_smooth/.")
    return path


def load_antiberty_tokenizer():
    """AntiBERTy's tokenizer: a case-sensitive :class:`transformers.BertTokenizer` over the
    package's ``vocab.txt``, which splits space-separated residues (see :func:`spaced`).

    Built with ``from_pretrained`` on the folder holding ``vocab.txt``: on transformers 5 the
    ``vocab_file`` argument of the constructor is ignored. Special tokens: ``[PAD]`` 0,
    ``[UNK]`` 1, ``[CLS]`` 2, ``[SEP]`` 3, ``[MASK]`` 4; residues 5...24.
    """
    from transformers import BertTokenizer

    tokenizer = BertTokenizer.from_pretrained(antiberty_dir(), do_lower_case=False)
    expected = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}
    got = {t: tokenizer.convert_tokens_to_ids(t) for t in expected}
    if got != expected or len(tokenizer) != 25 or tokenizer.mask_token_id != 4:
        raise RuntimeError(
            f"AntiBERTy's tokenizer loaded with special tokens {got} and {len(tokenizer)} "
            f"tokens; expected {expected} and 25. The installed transformers "
            "may read vocab.txt differently."
        )
    return tokenizer


def load_antiberty():
    """The pre-trained AntiBERTy masked language model as a
    :class:`transformers.BertForMaskedLM` in ``eval()`` mode, and its tokenizer.

    :returns: ``(model, tokenizer)``.

    Example::

        >>> model, tokenizer = load_antiberty()
        >>> sum(p.numel() for p in model.parameters()) // 10**6
        25
    """
    from transformers import BertForMaskedLM
    from transformers.utils import logging

    path = os.path.join(antiberty_dir(), "AntiBERTy_md_smooth")
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()  # the checkpoint's extra species/chain heads are expected
    logging.disable_progress_bar()
    try:
        model = BertForMaskedLM.from_pretrained(path)
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
    return model.eval(), load_antiberty_tokenizer()


def random_antiberty(seed=0):
    """AntiBERTy's architecture with random weights (the configuration's initialiser), in
    ``eval()`` mode: the paper's "random init." baseline.

    :param int seed: seed of the initial weights.
    """
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig.from_pretrained(os.path.join(antiberty_dir(), "AntiBERTy_md_smooth"))
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = BertForMaskedLM(config)
    finally:
        torch.random.set_rng_state(state)
    return model.eval()


def spaced(sequence):
    """``"EVQL"`` -> ``"E V Q L"``: the residue-per-token text AntiBERTy's tokenizer reads.

    :raises ValueError: for a character that is not one of the 20 amino acids.
    """
    letters = sequence.replace(" ", "").upper()
    bad = sorted(set(letters) - set("ACDEFGHIKLMNPQRSTVWY"))
    if bad:
        raise ValueError(
            f"sequence has characters {bad} that are not amino-acid letters "
            "(ACDEFGHIKLMNPQRSTVWY); remove them."
        )
    return " ".join(letters)
