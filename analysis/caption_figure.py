"""The paper's Figure 1 on our data: a photo's caption, word by word, with the prior's attention and
the posterior's (mean and a few draws) drawn over the photo.

One row per generated word (the word is predicted at that step), one column per panel: the
contextual prior's attention (the same at every step: it reads the image regions only), the
posterior mean, then single posterior draws. Each panel is the photo as the CNN saw it (squashed
to a square) under the 7 x 7 grid of weights, upsampled; the panels of a row share one colour
scale, so a draw that is sharper or flatter than the mean shows as such.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from analysis.plots import plt, save_figure

#: a panel is 1.6 inches: at 80 dpi about 128 pixels, which the photo is resized to, in a palette
#: of 128 colours (a caption of ten words is 50 panels; at 120 dpi in RGB the PNG took 2 MB)
FIGURE_DPI = 80
PANEL_PIXELS = 128
FIGURE_COLORS = 128


def grid_side(cells: int) -> int:
    side = math.isqrt(cells)
    if side * side != cells:
        raise ValueError(f"attention over {cells} cells is not a square grid")
    return side


def attention_figure(photo: Path, words: Sequence[str], prior: np.ndarray, posterior_mean: np.ndarray,
                     samples: np.ndarray, path: Path, title: str = "") -> Path:
    """Draw the figure (see module doc) into ``path`` (PNG).

    ``prior`` and ``posterior_mean``: ``[steps, cells]``; ``samples``: ``[steps, draws, cells]``;
    ``words``: the caption's words, one per step (``steps`` of them; EOS may be the last).
    """
    from PIL import Image

    steps, cells = posterior_mean.shape
    if len(words) != steps or prior.shape != (steps, cells) or samples.shape[::2] != (steps, cells):
        raise ValueError(f"{len(words)} words, prior {prior.shape}, posterior mean {posterior_mean.shape} and "
                         f"samples {samples.shape} do not describe the same steps and cells")
    side = grid_side(cells)
    with Image.open(photo) as image:
        pixels = np.asarray(image.convert("RGB").resize((PANEL_PIXELS, PANEL_PIXELS)))
    panels = [("prior", prior), ("posterior mean", posterior_mean),
              *((f"draw {d + 1}", samples[:, d]) for d in range(samples.shape[1]))]
    fig, axes = plt.subplots(steps, len(panels), figsize=(1.6 * len(panels), 1.6 * steps + 0.4), squeeze=False)
    for step, word in enumerate(words):
        top = max(float(values[step].max()) for _, values in panels)
        for column, (name, values) in enumerate(panels):
            ax = axes[step, column]
            ax.imshow(pixels, extent=(0, side, side, 0))
            ax.imshow(values[step].reshape(side, side), cmap="inferno", alpha=0.6, vmin=0.0, vmax=top,
                      extent=(0, side, side, 0), interpolation="bilinear")
            ax.set_xticks([])
            ax.set_yticks([])
            if step == 0:
                ax.set_title(name, fontsize=9)
            if column == 0:
                ax.set_ylabel(word, fontsize=10, rotation=0, ha="right", va="center")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path, dpi=FIGURE_DPI, colors=FIGURE_COLORS)
