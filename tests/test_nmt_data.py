"""Multi30k: reading the files, the cached joint BPE, length filtering, batches and BLEU."""

import gzip

import numpy as np
import pytest
import sentencepiece as spm

from experiments.nmt import multi30k
from experiments.nmt.multi30k import BOS, EOS, PAD, BpeSettings, load_multi30k, read_split, train_bpe
from tests.nmt_support import toy_pairs, write_corpus


@pytest.fixture
def toy_root(tmp_path):
    return write_corpus(tmp_path / "data")


def test_reads_the_real_splits(data_root):
    sizes = {"train": 29000, "val": 1014, "test": 1000}
    for split, size in sizes.items():
        pairs = read_split(split, data_root)
        assert len(pairs) == size and len(pairs.target) == size
    first = read_split("val", data_root)
    assert first.source[0].startswith("Eine Gruppe von Männern") and first.target[0].startswith("A group of men")


def test_missing_files_are_named_with_the_folder(tmp_path):
    (tmp_path / "multi30k").mkdir()
    with pytest.raises(FileNotFoundError, match=rf"val\.de\.gz, val\.en\.gz in {tmp_path / 'multi30k'}"):
        read_split("val", tmp_path)
    with pytest.raises(ValueError, match="unknown Multi30k split 'dev'"):
        read_split("dev", tmp_path)


def _write(path, lines):
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")


def test_bad_files_get_clear_errors(toy_root):
    folder = toy_root / "multi30k"
    _write(folder / "val.en.gz", ["A dog.", "   ", "A cat."] + ["A man."] * 37)
    with pytest.raises(ValueError, match=r"val\.de\.gz.*\(en\), line 2: empty sentence"):
        read_split("val", toy_root)
    _write(folder / "val.en.gz", ["A dog."])
    with pytest.raises(ValueError, match="40 de sentences but 1 en sentences"):
        read_split("val", toy_root)
    (folder / "val.en.gz").write_text("plain text, not gzip")
    with pytest.raises(ValueError, match=r"val\.en\.gz, line 1: not a whole gzip file"):
        read_split("val", toy_root)


def test_bpe_is_cached_in_the_user_cache_never_under_the_data_root(toy_root, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    before = sorted(p.relative_to(toy_root) for p in toy_root.rglob("*"))
    data = load_multi30k(toy_root, BpeSettings(vocab_size=60))
    assert sorted(p.relative_to(toy_root) for p in toy_root.rglob("*")) == before
    models = list((cache / "bam-pyro" / "multi30k-bpe").glob("*.model"))
    assert len(models) == 1 and data.vocab_size == 60
    # a second load reads the cached model instead of training again
    monkeypatch.setattr(spm.SentencePieceTrainer, "train", lambda **kw: pytest.fail("trained again"))
    again = load_multi30k(toy_root, BpeSettings(vocab_size=60))
    assert again.train.sources[0].tolist() == data.train.sources[0].tolist()


def test_the_cache_key_follows_the_corpus_and_the_settings(tmp_path):
    pairs = multi30k.SentencePairs(*toy_pairs(200))
    other = multi30k.SentencePairs(pairs.source[:-1] + ["Ein hund."], pairs.target)
    key = multi30k.bpe_cache_key(pairs, BpeSettings(60))
    assert key == multi30k.bpe_cache_key(multi30k.SentencePairs(list(pairs.source), list(pairs.target)), BpeSettings(60))
    assert key != multi30k.bpe_cache_key(other, BpeSettings(60))
    assert key != multi30k.bpe_cache_key(pairs, BpeSettings(61))
    train_bpe(pairs, BpeSettings(60), tmp_path)
    train_bpe(pairs, BpeSettings(61), tmp_path)
    assert len(list((tmp_path / "multi30k-bpe").glob("*.model"))) == 2
    with pytest.raises(ValueError, match="vocab_size=5000"):
        train_bpe(pairs, BpeSettings(5000), tmp_path)


def test_long_pairs_are_dropped_from_training_only(toy_root, tmp_path):
    full = load_multi30k(toy_root, BpeSettings(60), max_length=1000, cache=tmp_path)
    limit = int(np.median([max(len(s), len(t)) for s, t in zip(full.train.sources, full.train.targets)]))
    short = load_multi30k(toy_root, BpeSettings(60), max_length=limit, cache=tmp_path)
    too_long = sum(max(len(s), len(t)) > limit for s, t in zip(full.train.sources, full.train.targets))
    assert 0 < too_long < len(full.train)
    assert short.dropped == too_long and len(short.train) == len(full.train) - too_long
    assert max(max(len(s), len(t)) for s, t in zip(short.train.sources, short.train.targets)) <= limit
    for split in ("val", "test"):
        assert len(getattr(short, split)) == len(getattr(full, split)) == 40
        assert max(len(s) for s in getattr(short, split).sources) > limit  # long ones are kept
    with pytest.raises(ValueError, match="no training pair has at most max_length=1"):
        load_multi30k(toy_root, BpeSettings(60), max_length=1, cache=tmp_path)


def test_batches_frame_the_targets_and_an_epoch_depends_on_its_seed_alone(toy_root, tmp_path):
    split = load_multi30k(toy_root, BpeSettings(60), cache=tmp_path).train
    epoch = list(split.training_batches(16, np.random.default_rng([0, 3])))
    again = list(split.training_batches(16, np.random.default_rng([0, 3])))
    other = list(split.training_batches(16, np.random.default_rng([0, 4])))
    assert all((a.src == b.src).all() for a, b in zip(epoch, again))
    assert any(a.src.shape != b.src.shape or (a.src != b.src).any() for a, b in zip(epoch, other))
    assert len(epoch) == split.num_batches(16)
    seen = sorted(tuple(row[mask].tolist()) for b in epoch for row, mask in zip(b.src, b.src_mask))
    assert seen == sorted(tuple(s.tolist()) for s in split.sources)  # every pair once
    batch = epoch[0]
    for row in range(batch.src.size(0)):
        n = int(batch.tgt_mask[row].sum())
        assert batch.tgt_in[row, 0] == BOS and batch.tgt_out[row, n - 1] == EOS
        assert (batch.tgt_in[row, 1:n] == batch.tgt_out[row, : n - 1]).all()
        assert (batch.tgt_out[row, n:] == PAD).all() and (batch.src[row][~batch.src_mask[row]] == PAD).all()


def test_evaluation_batches_cover_the_split_in_index_order(toy_root, tmp_path):
    split = load_multi30k(toy_root, BpeSettings(60), cache=tmp_path).val
    indices = np.concatenate([i for i, _ in split.ordered_batches(7)])
    assert sorted(indices.tolist()) == list(range(len(split)))
    for index, batch in split.ordered_batches(7):
        assert batch.src[0][batch.src_mask[0]].tolist() == split.sources[index[0]].tolist()


def test_without_a_data_root_the_hub_copy_is_read(tmp_path, monkeypatch):
    """No data root anywhere (a user's machine): ``datasets`` fetches Multi30k from the hub. The hub
    is out of reach here, so its answer is a toy table in the hub's columns."""
    import datasets

    source, target = toy_pairs(5)
    asked = []
    monkeypatch.setattr(multi30k, "resolve_data_root", lambda root: (tmp_path, False))
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: asked.append((a, kw)) or
                        datasets.Dataset.from_dict({"de": source, "en": target}))
    pairs = read_split("test")
    assert asked == [(("bentrevett/multi30k",), {"split": "test", "cache_dir": str(tmp_path / "datasets")})]
    assert pairs.source == source and pairs.target == target


def test_bleu_of_the_references_is_100_also_through_the_bpe(data_root, tmp_path):
    from experiments.nmt.task import bleu

    references = read_split("val", data_root).target
    assert bleu(references, references) == pytest.approx(100.0)
    bpe = train_bpe(read_split("train", data_root), BpeSettings(8000), tmp_path)
    detokenized = [bpe.decode(ids) for ids in bpe.encode(references)]
    assert bleu(detokenized, references) == pytest.approx(100.0)
    assert bleu(references[1:] + references[:1], references) < 5
    with pytest.raises(ValueError, match="3 hypotheses for 1014 references"):
        bleu(references[:3], references)
