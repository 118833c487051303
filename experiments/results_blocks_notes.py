"""Rendered sentences that read figures of a result file aloud, so that prose around the
tables quotes no number by hand."""

from experiments.results_format import num

__all__ = ["gp_decoder_summary_block"]


def gp_decoder_summary_block(ctx):
    """The exact LML, held-out LPD and largest-N epoch time of the MPT objectives of
    ``gp-decoder`` against the exact objective's, and the gaps, from one seed."""
    res = ctx.json("gp-decoder.json")
    cfg, quality, timing = res["config"], res["quality"], res["timing"]
    exact = quality["exact LML"]
    labels = {
        "MPT uniform": "the uniform-rate MPT objective",
        "MPT |R|=128": f"the active-set MPT objective (|R|={cfg['context']})",
    }
    methods = [m for m in labels if m in quality]
    lml = "; ".join(
        f"{labels[m]} reaches {num(quality[m]['lml_per_image'], 1)}, "
        f"{num(exact['lml_per_image'] - quality[m]['lml_per_image'], 1)} nats per image below it"
        for m in methods
    )
    largest = cfg["sizes"][-1]
    exact_time = timing["exact LML"][-1]
    times = " and ".join(
        f"{num(timing[m][-1], 3)} s ({m.split(' ', 1)[1]}, {timing[m][-1] / exact_time:.2f}×)"
        for m in methods
    )
    lpd = " and ".join(f"{num(quality[m]['held_out_lpd'], 3)}" for m in methods)
    return (
        f"From one seed (one data draw and initialisation; no spread is measured): the exact "
        f"objective reaches the highest exact LML, {num(exact['lml_per_image'], 1)} nats per "
        f"image, as it should; {lml}. At N={largest} an epoch of the MPT objectives takes "
        f"{times} against {num(exact_time, 3)} s for the exact objective, and on the held-out "
        f"pixels they score {lpd} nats per pixel against its {num(exact['held_out_lpd'], 3)}."
    )
