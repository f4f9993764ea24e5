"""Captioning: grid features of real photos and their cache, the data readers, Att2in's attention
sites, training that learns, decoding that stops at EOS, and the errors users meet."""

import json

import numpy as np
import pytest
import torch
from pyro import poutine
from pyro.infer import TraceMeanField_ELBO

from bam_pyro import AttentionGuide, BamConfig, ObjectiveConfig
from bam_pyro.alignment import AlignmentConfig, LatentAlignmentModel, elbo_for, guide_for
from experiments.captioning.features import CHANNELS, GRID_CELLS, GridFeatureExtractor, ImageError, load_pixels
from experiments.captioning.captions import (BOS, EOS, PAD, UNK, Vocabulary, build_caption_data, read_flickr_subset,
                                  read_karpathy, split_by_image)
from experiments.captioning.task import CaptioningSettings
from models.captioning import Att2inSizes, CaptionNetwork, build_captioner
from models.decoding import greedy

TINY = Att2inSizes(embedding=16, hidden=16, attention=16, dropout=0.0)
WC = BamConfig("wc", k=10.0, beta=1e-6, d_mid=4)


@pytest.fixture(autouse=True)
def _one_thread():
    """The tiny models' ops are too small to share out: a second thread only waits (and spins on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def photos(data_root):
    """Two real photos of the Flickr8k subset with their captions."""
    return read_flickr_subset(data_root / "flickr8k_subset")[:2]


@pytest.fixture(scope="module")
def tiny_data(photos):
    """Both photos in every split, their 10 captions, every word kept; stand-in grids (seeded, of
    the CNN's shape and range), so that only the feature test loads the CNN."""
    grids = dict(zip([p.path for p in photos], 6 * torch.rand(2, GRID_CELLS, CHANNELS, generator=torch.Generator().manual_seed(0))))
    return build_caption_data({"train": photos, "val": photos, "test": photos},
                              lambda paths: torch.stack([grids[p] for p in paths]), min_count=1, max_words=16)


def test_features_of_real_photos_are_the_7x7_grid_and_are_cached(photos, tmp_path):
    extractor = GridFeatureExtractor(cache=tmp_path)
    grids = extractor([p.path for p in photos])
    assert grids.shape == (2, GRID_CELLS, CHANNELS) and grids.dtype == torch.float32
    assert bool((grids >= 0).all()) and bool((grids <= 6).all()) and grids.std() > 0  # ReLU6 activations
    assert not torch.equal(grids[0], grids[1])
    assert extractor.computed == 2 and len(list(tmp_path.rglob("*.pt"))) == 2
    again = GridFeatureExtractor(cache=tmp_path)  # a new process would read the same files
    torch.testing.assert_close(again([p.path for p in reversed(photos)]), grids.flip(0))
    assert again.computed == 0 and again._network is None  # read back: the network was never loaded
    torch.testing.assert_close(extractor.compute([photos[1].path]), grids[1:], atol=1e-4, rtol=1e-4)  # the cache holds the CNN's grid


def test_a_missing_or_unreadable_image_is_named(tmp_path):
    missing = tmp_path / "nowhere.jpg"
    with pytest.raises(ImageError, match="image not found: .*nowhere.jpg"):
        GridFeatureExtractor(cache=tmp_path)([missing])
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"not a jpeg at all")
    with pytest.raises(ImageError, match="cannot read image .*broken.jpg"):
        load_pixels(broken)


def test_the_subset_splits_by_photo_reproducibly(data_root):
    images = read_flickr_subset(data_root / "flickr8k_subset")
    assert len(images) == 1000 and all(len(image.captions) == 5 for image in images)
    splits = split_by_image(images, (800, 100, 100), seed=0)
    names = {split: {image.name for image in part} for split, part in splits.items()}
    assert [len(names[s]) for s in ("train", "val", "test")] == [800, 100, 100]
    assert not (names["train"] & names["val"]) and not (names["train"] & names["test"]) and not (names["val"] & names["test"])
    assert names == {s: {i.name for i in p} for s, p in split_by_image(images, (800, 100, 100), seed=0).items()}
    assert names["test"] != {i.name for i in split_by_image(images, (800, 100, 100), seed=1)["test"]}
    assert images[0].words[0][:4] == ("a", "child", "in", "a")  # PTB-tokenized: lowercase, no final "."


def test_karpathy_reader(tmp_path):
    document = {"images": [
        {"split": "train", "filepath": "train2014", "filename": "a.jpg",
         "sentences": [{"raw": "A dog runs.", "tokens": ["a", "dog", "runs"]}, {"raw": "The dog's ball!", "tokens": []}]},
        {"split": "restval", "filepath": "val2014", "filename": "b.jpg", "sentences": [{"tokens": ["Two", "cats"]}]},
        {"split": "val", "filename": "c.jpg", "sentences": [{"raw": "A cat.", "tokens": ["a", "cat"]}]},
        {"split": "test", "filename": "d.jpg", "sentences": [{"raw": "A bird", "tokens": ["a", "bird"]}]},
    ]}
    path = tmp_path / "dataset_coco.json"
    path.write_text(json.dumps(document))
    splits = read_karpathy(path, tmp_path / "coco")
    assert [image.name for image in splits["train"]] == ["train2014/a.jpg", "val2014/b.jpg"]  # restval joins train
    first = splits["train"][0]
    assert first.path == tmp_path / "coco" / "train2014" / "a.jpg"
    assert first.words == (("a", "dog", "runs"), ("the", "dog", "'s", "ball"))  # the scorer's tokens of the raw text
    assert splits["train"][1].words == (("two", "cats"),) and splits["train"][1].captions == ("Two cats",)
    assert splits["val"][0].path == tmp_path / "coco" / "c.jpg" and len(splits["test"]) == 1
    document["images"][2]["split"] = "dev"
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match="image 2 has split 'dev'"):
        read_karpathy(path, tmp_path)
    del document["images"][0]["filename"]
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match="image 0 lacks 'filename'"):
        read_karpathy(path, tmp_path)


def test_vocabulary_and_framing(tiny_data):
    vocabulary = Vocabulary([("a", "dog"), ("a", "cat"), ("a", "dog")], min_count=2)
    assert vocabulary.words[4:] == ["a", "dog"] and vocabulary.encode(["a", "cat"]) == [4, UNK]
    assert vocabulary.decode([4, UNK, 5, EOS, 4]) == "a dog"  # stops at EOS, unknown words left out
    train = tiny_data.train
    assert len(train) == 10 and train.tgt_in.shape[1] == 17
    row = train.tgt_mask[0].sum() - 1  # the caption's last position holds EOS in tgt_out
    assert train.tgt_in[0, 0] == BOS and train.tgt_out[0, row] == EOS and train.tgt_out[0, row + 1:].eq(PAD).all()
    torch.testing.assert_close(train.tgt_in[:, 1:], train.tgt_out[:, :-1].masked_fill(train.tgt_out[:, :-1] == EOS, PAD))


def test_each_step_is_an_attention_site_whose_weights_sum_to_one(tiny_data):
    model = build_captioner(len(tiny_data.vocabulary), tiny_data.feature_size, TINY, WC, ObjectiveConfig())
    model.record_attention = True
    batch = tiny_data.train.batch(torch.arange(4))
    trace = poutine.trace(AttentionGuide(model.model)).get_trace(*batch.inputs, tgt_out=batch.tgt_out)
    length = batch.tgt_in.size(1)
    sites = [f"attention#{t + 1}" if t else "attention" for t in range(length)]
    assert [n for n in trace.nodes if n.startswith("attention") and not n.endswith(".weights")] == sites
    assert model.num_sites == length  # the mean reduction averages the KL over the steps
    for t, name in enumerate(sites):
        weights = trace.nodes[f"{name}.weights"]["value"]
        assert weights.shape == (4, 1, 1, GRID_CELLS)
        torch.testing.assert_close(weights.sum(-1), torch.ones(4, 1, 1))
        # a caption that has ended has no KL at this step: its row is masked out of the site
        assert torch.equal(trace.nodes[name]["fn"].mask[:, 0, 0, 0], batch.tgt_mask[:, t])


def caption_nll(model, batch) -> float:
    """Mean negative log-likelihood per word of the batch's captions, as the model predicts them."""
    model.eval()
    with torch.no_grad():
        log_probs = model.log_probs(*batch.inputs).gather(-1, batch.tgt_out.unsqueeze(-1)).squeeze(-1)
    model.train()
    return float(-log_probs[batch.tgt_mask].mean())


@pytest.mark.parametrize("variant", ["wc", "hard"])
def test_a_short_run_learns_the_captions(tiny_data, variant):
    torch.manual_seed(0)
    vocab, features = len(tiny_data.vocabulary), tiny_data.feature_size
    if variant == "hard":
        model = LatentAlignmentModel(CaptionNetwork(vocab, features, TINY, BamConfig("soft")), ObjectiveConfig(),
                                     AlignmentConfig("hard"))
        guide, elbo = guide_for(model), elbo_for("hard")
    else:
        model = build_captioner(vocab, features, TINY, WC, ObjectiveConfig())
        guide, elbo = AttentionGuide(model.model), TraceMeanField_ELBO(max_plate_nesting=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = tiny_data.train.batch(torch.arange(10))
    args, kwargs = batch.model_args
    before = caption_nll(model, batch)
    for step in range(30):
        loss = elbo.differentiable_loss(model.model, guide, *args, **kwargs, step=step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert caption_nll(model, batch) < 0.8 * before  # measured: 4.05 -> 2.87 (wc)


def test_greedy_decoding_stops_at_the_end_token(tiny_data):
    model = build_captioner(len(tiny_data.vocabulary), tiny_data.feature_size, TINY, BamConfig("soft"), ObjectiveConfig())
    _, features, mask = next(tiny_data.test.image_batches(2))
    with torch.no_grad():
        model.network.output.weight.zero_()
        model.network.output.bias.fill_(0.0)
        model.network.output.bias[7] = 5.0  # word 7 is always the most probable
    assert greedy(model, features, mask, BOS, EOS, max_length=16) == [[7] * 16] * 2  # until the length limit
    predict, steps = model.next_token_log_probs, []

    def eos_for_the_first_photo_at_step_4(memory, outputs):
        log_probs = predict(memory, outputs)
        steps.append(log_probs.size(0))
        if len(steps) == 4:
            log_probs[0, EOS] = 0.0
        return log_probs

    model.next_token_log_probs = eos_for_the_first_photo_at_step_4
    assert greedy(model, features, mask, BOS, EOS, max_length=16) == [[7] * 3, [7] * 16]
    assert steps[:5] == [2, 2, 2, 2, 1]  # after its EOS the first photo is decoded no further


def test_settings_errors_name_the_field():
    with pytest.raises(ValueError, match="karpathy_json must be given with --dataset karpathy"):
        CaptioningSettings(karpathy_json="dataset_coco.json")
    with pytest.raises(ValueError, match="max_words must be a whole number >= 1"):
        CaptioningSettings(max_words=0)
    with pytest.raises(ValueError, match="variant must be one of"):
        CaptioningSettings(variant="nokl")


def test_posterior_draws_of_every_step_beside_the_prior(tiny_data):
    from experiments.captioning.attention import attention_draws

    model = build_captioner(len(tiny_data.vocabulary), tiny_data.feature_size, TINY, WC, ObjectiveConfig())
    posterior, prior = attention_draws(model, tiny_data.test, draws=5)
    steps = tiny_data.test.batch(torch.arange(len(tiny_data.test))).tgt_in.size(1)
    assert posterior.shape == (5, 10, steps, GRID_CELLS) and prior.shape == (10, steps, GRID_CELLS)
    valid = tiny_data.test.tgt_mask[:, :steps].numpy()
    assert np.isnan(posterior[:, ~valid]).all() and np.isnan(prior[~valid]).all()  # steps after EOS
    np.testing.assert_allclose(posterior[:, valid].sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(prior[valid].sum(-1), 1.0, rtol=1e-6)
    assert np.ptp(posterior[:, valid], axis=0).max() > 0  # draws differ: q(S | Phi), not its mean
    for row in range(10):  # the contextual prior reads the image alone: one map for every step of a caption
        np.testing.assert_allclose(prior[row, valid[row]], np.broadcast_to(prior[row, 0], prior[row, valid[row]].shape), rtol=1e-5)


@pytest.mark.slow  # fresh processes that load the cached features of all 1,000 photos
def test_bench_prints_interleaved_time_and_memory_ratios(capsys):
    from experiments.captioning import benchmark as bench

    bench.main(["--batch", "5", "--steps", "3", "--warmup", "1", "--memory-repeats", "1"])
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["soft_ms"] > 0 and figures["bam_ms"] > 0 and figures["soft_peak_mb"] > 0
    low, high = figures["time_ratio_iqr"]
    assert low <= figures["time_ratio"] <= high
    assert figures["mem_ratio"] == pytest.approx(figures["bam_peak_mb"] / figures["soft_peak_mb"], rel=0.01)
