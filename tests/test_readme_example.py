"""The README's example runs as written and shows learning: the trained model starts far
from the data-generating one and ends near it (it does not start at the truth through
Pyro's shared param store)."""

import contextlib
import io
import pathlib
import re

import pytest
import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _example_code():
    text = README.read_text()
    section = text.split("## Example", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.skipif(not README.exists(), reason="README.md ships with the repository only")
def test_readme_example_learns_from_a_start_away_from_the_truth():
    out = io.StringIO()
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # as a user runs it
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(_example_code(), str(README), "exec"), {"__name__": "readme"})
    finally:
        torch.set_default_dtype(dtype)
    figures = dict(
        (line.rsplit(None, 1)[0].split("  ")[0], float(re.findall(r"-?\d+\.\d+", line)[-1]))
        for line in out.getvalue().splitlines()
        if re.search(r"-?\d+\.\d+", line)
    )
    start = next(v for k, v in figures.items() if "start" in k)
    after = next(v for k, v in figures.items() if "after" in k and "MPT" not in k)
    truth = next(v for k, v in figures.items() if "data-generating" in k)
    # Training moves the exact LML by nats, to within a tenth of a nat of the truth's
    # (500 observations of 10 features: the fitted model may even score a little higher).
    assert after - start > 5.0
    assert abs(after - truth) < 0.1
