"""One process of the two-process checks of tests/test_distributed.py, started by ``torchrun``:

    torchrun --standalone --nproc_per_node=2 -m tests.distributed_worker OUT

Each process trains a small Bayesian GAT with :class:`~bam_pyro.training.SVITrainer` on Lightning
Fabric (DDP over gloo) three ways and saves what it ended with to ``OUT/<case>-rank<r>.pt``:

- ``noisy``: BAM-WC with dropout, two epochs of six minibatches, uninterrupted;
- ``resumed``: the same run killed two steps into its second epoch (a checkpoint after every
  step) and resumed by a fresh trainer;
- ``soft``: soft attention without dropout (no noise at all), one epoch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import torch

from bam_pyro import AttentionGuide, BamConfig, ObjectiveConfig
from bam_pyro.distributed import DeviceSettings, Engine, engine_for
from bam_pyro.training import SVITrainer, seed_everything
from models.gat import build_node_classifier

from .conftest import random_graph

#: the training nodes, in six minibatches of five (each epoch shuffles their order)
MINIBATCHES = 6


class Crash(Exception):
    """Stands in for a kill between two steps."""


def make_trainer(variant: str, engine: Optional[Engine] = None, checkpoint: Optional[Path] = None,
                 crash_after: Optional[int] = None, merge: int = 1):
    """A trainer of a small GAT, its batches and its evaluation. ``merge``: nodes of that many
    consecutive minibatches go into one batch (one process's view of a ``merge``-process step);
    ``crash_after``: raise :class:`Crash` once that many batches were built."""
    seed_everything(0)
    x, edge_index, y = random_graph(num_nodes=40, num_edges=160)
    noisy = variant != "soft"
    model = build_node_classifier(x.size(1), 3, BamConfig(variant, k=2.0), ObjectiveConfig(anneal_rate=0.3),
                                  heads=2, hidden=4, dropout=0.5 if noisy else 0.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    trainer = SVITrainer(model, AttentionGuide(model.model), optimizer, checkpoint=checkpoint,
                         checkpoint_seconds=0.0 if checkpoint else None, engine=engine)
    built = 0

    def batches():
        nonlocal built
        order = torch.randperm(30).split(30 // MINIBATCHES)
        for start in range(0, MINIBATCHES, merge):
            if built == crash_after:
                raise Crash
            built += 1
            yield (x, edge_index), dict(y=y, nodes=torch.cat(order[start:start + merge]))

    def evaluate():
        device = next(model.parameters()).device  # where the engine put the model
        logits = model.network(x.to(device), edge_index.to(device))
        return {"val_loss": torch.nn.functional.cross_entropy(logits[30:], y[30:].to(device)).item()}

    return trainer, batches, evaluate


def outcome(trainer: SVITrainer) -> dict:
    return {"params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, "history": trainer.history}


def main(out: Path) -> None:
    engine = engine_for(DeviceSettings(accelerator="cpu"))  # devices and strategy "auto": the launcher's 2, DDP
    rank = engine.rank

    trainer, batches, evaluate = make_trainer("wc", engine)
    trainer.fit(batches, evaluate, max_epochs=2, progress=False)
    (args, kwargs), = [next(iter(batches()))]
    probe = trainer.elbo.differentiable_loss(trainer.model.model, trainer.guide, *args, step=trainer.global_step,
                                             **kwargs).item()
    torch.save({**outcome(trainer), "probe_loss": probe}, out / f"noisy-rank{rank}.pt")

    checkpoint = out / "checkpoint.pt"
    crashed, batches, evaluate = make_trainer("wc", engine, checkpoint, crash_after=MINIBATCHES + 4)
    try:
        crashed.fit(batches, evaluate, max_epochs=2, progress=False)
    except Crash:
        pass
    torch.manual_seed(1234 + rank)  # whatever happens to the random state in between must not matter
    resumed, batches, evaluate = make_trainer("wc", engine, checkpoint)
    resumed.fit(batches, evaluate, max_epochs=2, progress=False)
    torch.save(outcome(resumed), out / f"resumed-rank{rank}.pt")

    soft, batches, evaluate = make_trainer("soft", engine)
    soft.fit(batches, evaluate, max_epochs=1, progress=False)
    torch.save(outcome(soft), out / f"soft-rank{rank}.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
