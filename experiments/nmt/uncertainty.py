"""The attention posterior of sentences of your choosing, of a finished translation run: the figure
and ArviZ diagnostics of :mod:`experiments.nmt.attention` (which a training run writes for the first
validation sentences). The first run drawn; the target is the reference, or for ``--source`` the
given ``--target`` or else the model's own translation::

    python -m experiments.nmt.uncertainty runs/nmt/runs/multi30k-wc-seed0 --split test --sentences 17
    python -m experiments.nmt.uncertainty runs/nmt/runs/multi30k-wc-seed0 --source "Zwei Hunde spielen im Schnee."
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from experiments.nmt.multi30k import BOS, EOS, ParallelBatch, SentencePairs, check_pairs, encode_split, make_batch
from experiments.nmt.task import TASK, has_attention_posterior
from experiments.nmt.attention import CHAINS, SENTENCES, attention_uncertainty
from experiments.records import require_writable_folder
from experiments.runner import load_trained
from models.decoding import beam_search


def chosen_sentences(run_dir: Path, split_name: str, sentences: Sequence[int], source: Optional[str],
                     target: Optional[str], data_root: Optional[str], draws: int, chains: int, seed: int,
                     out: Optional[Path] = None) -> dict[str, Path]:
    """Load the finished run in ``run_dir``, draw the attention posterior of the chosen sentences
    (see module doc) into ``out`` (default: ``<run>/attention-<split>-<sentence>`` or
    ``<run>/attention-source``) and print the first one's source, target and translation."""
    settings, data, model = load_trained(TASK, run_dir, data_root)
    if not has_attention_posterior(settings):
        raise ValueError(f"{run_dir}: variant {settings.variant!r} has no attention posterior of its own to draw "
                         "(soft: fixed weights; nokl: no prior to set it against)")

    def translation(batch: ParallelBatch) -> str:
        return data.decode(beam_search(model, batch.src, batch.src_mask, BOS, EOS, settings.beam_size,
                                       settings.length_penalty)[0])

    if source is None:
        split, label = getattr(data, split_name), f"{split_name}-{sentences[0]}"
    else:
        if target is None:
            target = translation(make_batch([np.asarray(data.bpe.encode(source), dtype=np.int64)], [np.zeros(0, np.int64)]))
            if not target.strip():
                raise ValueError("the model translates --source to nothing (EOS first): pass the --target to draw along")
        split = encode_split(check_pairs(SentencePairs([source], [target]), "--source/--target"), data.bpe)
        sentences, label = (0,), "source"
    folder = Path(out) if out is not None else Path(run_dir) / f"attention-{label}"
    written = attention_uncertainty(model, data, folder, draws=draws, seed=seed, sentences=sentences, chains=chains,
                                    split=split)
    first = split.batch([sentences[0]])
    print(f"source:      {data.decode(first.src[0][first.src_mask[0]].tolist())}")
    print(f"target:      {data.decode(first.tgt_out[0][first.tgt_mask[0]][:-1].tolist())} (the attention is drawn along it)")
    print(f"translation: {translation(first)}")
    for name, path in written.items():
        print(f"{name}: {path}")
    return written


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(prog="python -m experiments.nmt.uncertainty", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="the folder of a finished translation run, <out>/runs/<run>")
    parser.add_argument("--split", choices=("val", "test"), default="val", help="the split the sentences are from")
    parser.add_argument("--sentences", type=int, nargs="+", default=list(SENTENCES),
                        help="their numbers in the split (from 0, file order); the figure shows the first")
    parser.add_argument("--source", help="a German sentence of your own instead")
    parser.add_argument("--target", help="with --source: the English target the attention is drawn along "
                                         "(default: the model's translation)")
    parser.add_argument("--draws", type=int, default=100, help="posterior draws per chain (at least 2)")
    parser.add_argument("--chains", type=int, default=CHAINS, help="independent chains of draws (for R-hat)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="output folder (default: a folder in the run's)")
    parser.add_argument("--data-root", default=None, help="data root (default: $BAM_DATA, ../shared/data, or a download cache)")
    args = parser.parse_args(argv)
    if args.target is not None and args.source is None:
        parser.error("--target goes with --source")
    if args.draws < 2 or args.chains < 1:
        parser.error("--draws must be at least 2 and --chains at least 1")
    try:
        if args.out is not None:
            require_writable_folder(args.out)
        return chosen_sentences(args.run, args.split, args.sentences, args.source, args.target, args.data_root,
                                args.draws, args.chains, args.seed, args.out)
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")


if __name__ == "__main__":
    main()
