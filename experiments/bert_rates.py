"""Masking rates for BERT pre-training from scratch: a fixed 15% (BERT), the uniform mask
size (unbiased MPT) and a random ratio per sequence (R2MAE), on BBC News.

Data: the 2,225 BBC News articles of :func:`experiments.text_corpus.load_bbc_news` (five topics),
split by article into training and held-out sets (15%, stratified by topic). A WordPiece
tokenizer (:func:`experiments.text_corpus.train_wordpiece_tokenizer`) is trained
on the training articles only, which are cut into sequences of ``L`` tokens
(``[CLS] ... [SEP]``).

Model and training: a small ``BertForMaskedLM`` (the same random initialisation for every
scheme) trained by :class:`pyro_mpt.transformers.MPTTrainer` with
:class:`~pyro_mpt.transformers.MPTDataCollator` (80/10/10 corruption, loss per maskable
token), AdamW with a linear warm-up (then a constant rate by default, a linear decay
with ``--full``), the same batches in the same order; only the
collator's ``rate`` differs: ``0.15``, ``"uniform"`` or ``(0.15, 0.5)``. With a fixed rate
the MPT weights are the constant ``D/M``, so that run is BERT's objective. Convergence:
:func:`experiments.mae_curve.loss_convergence` on the logged training losses (each the mean
over a fiftieth of the steps): the loss averaged over the last tenth of training against the
tenth ending at 80%, levelled off below a relative change of 2%.

Evaluation on the held-out articles (the first sequence of each):

* **area**: :func:`pyro_mpt.transformers.mlm_mpt_curve` at the midpoint rates 5%, 15%, ..., 95%,
  ``D · mean_r S(r)``, the estimate of ``log p(x)`` per sequence (nats; higher is better);
* **acc@15%**: the share of masked tokens predicted exactly (argmax) when 15% of the tokens
  are replaced by ``[MASK]`` (BERT's usual metric);
* **probe**: topic accuracy of a linear classifier (multinomial logistic regression, L2,
  standardised features) on the mean final hidden state over each article's first sequence
  (no masking), trained on the training articles, scored on the held-out ones.

The untrained model is listed as a reference. R2MAE (Tian et al., 2025) reports that random
ratios beat fixed ones; this table tests that claim with three seeds by default (``seeds``;
each seed repeats the split, the tokenizer, the initial weights, the batches and the masks,
shared by the schemes within it), mean ± sd over them, and the per-seed difference of each
scheme's area from the fixed 15% one (``--full``: a larger model, longer training, for a GPU).

.. note:: BERT trained from scratch first learns the token frequencies and stays on that
    "unigram plateau" until it learns to use the neighbouring tokens; a flat loss on the
    plateau would pass the convergence test, so the losses of the runs are kept in the
    result file to show that they left it. The default run is sized so that every scheme
    leaves the plateau early: a 300-piece vocabulary (words split into sub-word pieces whose
    neighbours are predictable), 16-token sequences, a 1-layer model of width 64 without
    dropout, batches of 256 at a constant learning rate 3e-3 after 200 warm-up steps, and
    6000 steps, about 40 minutes for three seeds on one CPU core. The fixed-15% runs leave
    the plateau last; the result file records whether each run levelled off by the end, and
    the note under the table counts them. The training loss falls
    below the unigram entropy even on the plateau, because it also scores the 10% of masked
    tokens that are left unchanged, which the model learns to copy.
"""

import tempfile

import torch

from experiments import _common as common
from experiments._bert_evaluation import evaluate_masked_lm
from experiments._experiment import Report
from experiments.mae_curve import CONVERGED_BELOW, loss_convergence

__all__ = ["NAME", "SCHEMES", "run"]

NAME = "bert-rates"

#: Scheme name -> the collator's ``rate``.
SCHEMES = {"fixed 15%": 0.15, "uniform": "uniform", "random (0.15, 0.5)": (0.15, 0.5)}
REFERENCE = "R2MAE (Tian et al., 2025) and Moreno-Muñoz et al. (2023), Sec. 3.2"
COLORS = {"random init": "0.5", "fixed 15%": "C3", "uniform": "C0", "random (0.15, 0.5)": "C2"}

#: What every size shares; each size sets the entries of ``_KEYS`` and its ``_CHANGES``.
_BASE = dict(held_out=0.15, init=0.02, dropout=0.1, lr=1e-3, warmup=0.05, schedule="linear")
_BASE.update(batch=32, probe_l2=1e-3)
_BASE.update(num_masks=2, rates=[round(0.05 + 0.1 * k, 2) for k in range(10)])
#: Per size: articles (None: all), vocabulary, tokens per sequence, width, layers, heads,
#: steps, batch, held-out sequences (None: all), seeds.
_KEYS = "articles vocab length hidden layers heads steps batch eval seeds".split()
_SIZES = {
    "smoke": (100, 300, 32, 32, 1, 2, 4, 8, 12, 1),
    # Short sequences of sub-word pieces from a small vocabulary, a one-layer model and
    # batches of 256 at a constant rate 3e-3 without dropout: every scheme leaves the
    # unigram plateau early (fixed 15% last); the result file records each run's
    # convergence.
    "default": (None, 300, 16, 64, 1, 2, 6000, 256, 200, 3),
    "full": (None, 8000, 128, 256, 4, 4, 6000, 64, None, 3),
}
_CHANGES = {
    "smoke": dict(rates=[0.25, 0.5, 0.75], num_masks=1),
    "default": dict(warmup=200, schedule="constant_with_warmup", lr=3e-3, dropout=0.0),
    "full": dict(num_masks=4, rates=[round(0.01 + 0.02 * k, 2) for k in range(50)]),
}


def _config(smoke, full):
    size = "smoke" if smoke else "full" if full else "default"
    return dict(_BASE, **dict(zip(_KEYS, _SIZES[size])), **_CHANGES[size])


def _data(cfg, seed):
    from experiments.text_corpus import chunk_documents, load_bbc_news, train_wordpiece_tokenizer
    from pyro_mpt.datasets import train_test_split

    texts, topics = load_bbc_news()
    index = torch.arange(len(texts))
    if cfg["articles"] is not None:  # a stratified subset
        index, _, topics, _ = train_test_split(
            index, topics, 1 - cfg["articles"] / len(texts), seed=seed
        )
    train, test, y_train, y_test = train_test_split(index, topics, cfg["held_out"], seed=seed)
    train_texts, test_texts = [texts[i] for i in train], [texts[i] for i in test]
    tokenizer = train_wordpiece_tokenizer(train_texts, vocab_size=cfg["vocab"])
    sequences, _ = chunk_documents(tokenizer, train_texts, cfg["length"])
    sequences = [s for s in sequences if len(s) > 2]
    first_train, _ = chunk_documents(tokenizer, train_texts, cfg["length"], max_chunks=1)
    first_test, _ = chunk_documents(tokenizer, test_texts, cfg["length"], max_chunks=1)
    return dict(
        tokenizer=tokenizer,
        train=sequences,
        probe_train=(first_train, y_train),
        probe_test=(first_test, y_test),
        held_out=first_test[: cfg["eval"]],
    )


def _model(cfg, tokenizer, seed):
    import transformers

    config = transformers.BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg["hidden"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        intermediate_size=4 * cfg["hidden"],
        max_position_embeddings=cfg["length"],
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=cfg["init"],
        hidden_dropout_prob=cfg["dropout"],
        attention_probs_dropout_prob=cfg["dropout"],
    )
    common.seed_everything(common.derived_seed(seed, 1))  # the same weights for every scheme
    return transformers.BertForMaskedLM(config)


def _train(model, data, cfg, rate, seed, device, bar):
    import transformers

    from pyro_mpt.transformers import MPTDataCollator, MPTTrainer

    class _Tick(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            bar.update()

    with tempfile.TemporaryDirectory() as out_dir:
        args = transformers.TrainingArguments(
            output_dir=out_dir,
            per_device_train_batch_size=cfg["batch"],
            max_steps=cfg["steps"],
            learning_rate=cfg["lr"],
            warmup_steps=cfg["warmup"],
            lr_scheduler_type=cfg["schedule"],
            weight_decay=0.01,
            logging_steps=max(1, cfg["steps"] // 50),
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=common.derived_seed(seed, 2),
            data_seed=common.derived_seed(seed, 3),
            use_cpu=device.type == "cpu",
            dataloader_num_workers=0,
        )
        trainer = MPTTrainer(
            model=model,
            args=args,
            train_dataset=[{"input_ids": row} for row in data["train"]],
            data_collator=MPTDataCollator(data["tokenizer"], rate=rate),
            normalize="tokens",
            callbacks=[_Tick()],
        )
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        with common.Stopwatch() as watch:
            trainer.train()
    history = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
    losses = [v for _, v in history]
    return dict(
        loss_steps=[s for s, _ in history],
        loss=losses,
        train_seconds=watch.seconds,
        # Each logged loss is the mean over an equal share of the steps.
        convergence=loss_convergence(losses),
    )


class _NoBar:
    def update(self, n=1):
        pass


def _warm_up(data, cfg, rate, seed, device):
    """One training step of a throwaway model, so that one-off costs (the trainer's set-up,
    torch's first calls) are not charged to the training seconds of the first scheme timed.
    The random state is restored: the runs are unchanged."""
    with common.preserved_rng():
        model = _model(cfg, data["tokenizer"], seed).to(device)
        _train(model, data, dict(cfg, steps=1, warmup=0), rate, seed, device, _NoBar())


def _measure(cfg, device, seed, progress):
    """Every scheme's record, and the untrained model's, at every seed; and the last seed's
    data."""
    runs = {name: [] for name in ("random init", *SCHEMES)}
    work = cfg["seeds"] * len(SCHEMES) * cfg["steps"]
    with common.progress_bar(total=work, enabled=progress, desc=NAME, unit="step") as bar:
        for run_seed in cfg["run_seeds"]:
            data = _data(cfg, run_seed)
            model = _model(cfg, data["tokenizer"], run_seed).to(device)
            runs["random init"].append(evaluate_masked_lm(model, data, cfg, run_seed, device))
            for name, rate in SCHEMES.items():
                _warm_up(data, cfg, rate, run_seed, device)
                model = _model(cfg, data["tokenizer"], run_seed).to(device)
                trained = _train(model, data, cfg, rate, run_seed, device, bar)
                trained.update(evaluate_masked_lm(model, data, cfg, run_seed, device))
                runs[name].append(trained)
                bar.set_postfix_str(f"{name}: area {trained['area']:.1f}")
    return runs, data


def _summary(reps, fixed):
    """One scheme's means (± sd) over the seeds."""
    keys = ("area", "area_per_token", "acc15", "probe")
    out = {k: common.mean_std([r[k] for r in reps]) for k in keys}
    seconds = [r["train_seconds"] for r in reps if "train_seconds" in r]
    out["train_seconds"] = sum(seconds) / len(seconds) if seconds else None
    # Paired by seed: the schemes of one seed share data, initial weights and batches.
    for key in ("area", "acc15", "probe"):
        gaps = [r[key] - f[key] for r, f in zip(reps, fixed)]
        out[f"{key}_minus_fixed"] = common.mean_std(gaps)
    out["relative_change"] = out["converged"] = None
    if "convergence" in reps[0]:
        out["relative_change"] = common.mean_std(
            [r["convergence"]["relative_change"] for r in reps]
        )
        out["converged"] = sum(r["convergence"]["converged"] for r in reps)
    return out


def _convergence_cell(s, seeds):
    """``k/n (change %)`` for a trained scheme, ``-`` for the untrained model."""
    if s["converged"] is None:
        return "-"
    change = common.spread_cell(s["relative_change"], 2, seeds, 100)
    return f"{s['converged']}/{seeds} ({change})"


def _report(cfg, runs, data):
    summary = {name: _summary(reps, runs["fixed 15%"]) for name, reps in runs.items()}
    rows = []
    for name, s in summary.items():
        cells = [("area", 1, 1.0), ("area_minus_fixed", 1, 1.0), ("area_per_token", 3, 1.0)]
        cells += [("acc15", 1, 100.0), ("probe", 1, 100.0)]
        rows.append(
            [name]
            + [
                common.spread_cell(s[key], digits, cfg["seeds"], scale)
                for key, digits, scale in cells
            ]
            + [_convergence_cell(s, cfg["seeds"])]
            + ["-" if s["train_seconds"] is None else f"{s['train_seconds']:.0f}"]
        )
    title = (
        f"bert-rates: BERT (hidden {cfg['hidden']}, {cfg['layers']} layers, vocab "
        f"{len(data['tokenizer'])}, {cfg['length']}-token sequences) trained from scratch on "
        f"BBC News ({len(data['train'])} training sequences; {cfg['steps']} steps of "
        f"{cfg['batch']}); held-out: {len(data['held_out'])} sequences, "
        f"{len(data['probe_test'][0])} articles"
        + (f"; {cfg['seeds']} seeds, mean ± std" if cfg["seeds"] > 1 else "; one seed")
    )
    notes = [
        f"area: D * mean S(r) over rates {cfg['rates'][0]}..{cfg['rates'][-1]} "
        f"({len(cfg['rates'])} rates, {cfg['num_masks']} masks each), nats per sequence "
        "(higher is better); per token: divided by the mean D.",
        "acc@15%: argmax accuracy on 15% [MASK]ed held-out tokens; probe: 5-topic linear-probe "
        "accuracy on held-out articles (chance 20-23%).",
        "converged: runs whose training loss (mean over a tenth of the run) changed by less "
        f"than {100 * CONVERGED_BELOW:g}% from 80% to 100% of training; in brackets that "
        "relative change (positive: still falling).",
    ]
    headers = ["scheme", "held-out area", "- fixed 15%", "area / token", "acc@15% (%)"]
    headers += ["probe (%)", "converged (change %)", "train s"]
    table = common.format_table(headers, rows, title=title, notes=notes)
    return Report(table, _figure(runs, cfg), dict(summary=summary, runs=runs))


def run(out_dir, device="cpu", smoke=False, full=False, seed=0, progress=True, seeds=None):
    """Trains a small BERT on BBC News with each masking scheme and writes
    ``bert-rates.json`` and ``bert-rates.png``.

    ``smoke``: 100 articles, a one-layer model, 4 steps (seconds); ``full``: hidden size 256,
    4 layers, 128-token sequences, 6000 steps of 64, three seeds (for a GPU); the default
    (hidden 64, 1 layer, a 300-piece vocabulary, 16-token sequences, 6000 steps of 256,
    three seeds) takes about 13 minutes per seed on one busy CPU core. ``seed`` is the base
    seed;
    ``seeds``: how many times to repeat everything (split, tokenizer, initial weights,
    batches, masks) from seeds derived from it, the tables giving mean ± sd over them
    (default: 1 at smoke size, 3 otherwise). The other arguments are those of
    :func:`~experiments._experiment.run_experiment`.

    This run follows the steps of ``run_experiment`` itself because its JSON names the
    papers under ``reference`` (before ``config``), not ``paper_reference``, and its
    ``config`` ends with what the data gave (vocabulary size, training sequences).
    """
    common.check_size(smoke, full)
    cfg = common.with_seeds(_config(smoke, full), seeds, seed)
    device = common.resolve_device(device)
    total = common.Stopwatch()
    with common.default_dtype(torch.float32):
        runs, data = _measure(cfg, device, seed, progress)
    shown = _report(cfg, runs, data)
    print(shown.table)
    settings = dict(
        schemes={k: str(v) for k, v in SCHEMES.items()}, threads=torch.get_num_threads()
    )
    settings.update(vocab_size=len(data["tokenizer"]), num_train_sequences=len(data["train"]))
    config = common.run_config(cfg, seed, smoke, full, device, **settings)
    results = dict(experiment=NAME, reference=REFERENCE, config=config, **shown.results)
    results["wall_seconds"] = total.elapsed
    return common.save_outputs(out_dir, NAME, results, shown.figure)


def _figure(runs, cfg):
    fig, (curves, losses) = common.new_figure(2, width=5.5)
    for name, reps in runs.items():
        scores = torch.tensor([r["scores"] for r in reps]).mean(0)
        curves.plot(
            [100 * r for r in cfg["rates"]], scores, "o-", ms=3, color=COLORS[name], label=name
        )
        if "loss" in reps[0]:
            losses.plot(reps[0]["loss_steps"], reps[0]["loss"], color=COLORS[name], label=name)
    curves.set_xlabel("masking rate (%)")
    curves.set_ylabel("held-out S(r): mean log q of a masked token")
    curves.set_title("MPT curves on held-out BBC News")
    losses.set_xlabel("step")
    losses.set_ylabel("training loss (MPT, nats per token)")
    losses.set_title("training (first seed)")
    curves.legend(fontsize="small")
    losses.legend(fontsize="small")
    return fig
