"""The translation task on the runner: settings, one run end to end, exact resume, every variant."""

import json
import math
import shutil
from pathlib import Path

import arviz as az
import numpy as np
import pandas as pd
import pytest
import torch
from pyro import poutine

from bam_pyro.training import SVITrainer
from experiments.nmt import task as nmt
from experiments.nmt.multi30k import BOS, EOS, EncodedSplit, ParallelBatch, make_batch
from experiments.nmt import uncertainty as nmt_uncertainty
from experiments.nmt.attention import alignment_draws, valid_entries
from bam_pyro.alignment import ALIGNMENT, guide_for, masked_scores
from experiments.records import CHECKPOINT, CHECKPOINT_SHA256, RECORD, file_sha256
from experiments.runner import RunContext, load_trained
from models.decoding import beam_hypotheses
from models.nmt import DecoderOutputs, DecoderState, Memory
from tests.nmt_support import write_corpus
from tests.test_latent_alignment import build as build_alignment_model
from tests.test_latent_alignment import network_tables, toy_batch


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def toy_root(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("data"), sizes=(300, 16, 16))


@pytest.fixture(autouse=True)
def _user_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))


def settings(variant="wc", **changes):
    quick = dict(preset="tiny", bpe_size=120, batch_size=32, max_epochs=2, beam_size=2, eval_batch_size=16,
                 uncertainty_draws=0)
    return nmt.NmtSettings(variant=variant, **nmt.presets("multi30k", variant), **{**quick, **changes})


def context(folder, run_settings, **options):
    """The runner's context of one run, checkpointing into ``folder`` under ``run_settings``."""
    return RunContext(folder, run_settings, progress=False, **options)


def test_presets_and_settings():
    assert nmt.presets("multi30k", "wc") == {"k": 5.0, "beta": 1e-6, "anneal_rate": 1.0, "d_mid": 5}  # paper, B.4
    assert nmt.presets("multi30k", "soft") == {}
    wc = settings("wc")
    assert wc.attention.variant == "wc" and wc.attention.k == 5.0 and wc.objective.anneal_rate == 1.0
    assert wc.length_limit == nmt.TRAINING_PRESETS["tiny"].max_length and settings(max_length=7).length_limit == 7
    assert nmt.NmtSettings().learning_rate == 1e-3 and nmt.NmtSettings(preset="paper").learning_rate == 3e-4
    assert settings(lr=0.5).learning_rate == 0.5
    assert set(nmt.TASK.variants) >= {"soft", "nokl", "lf", "lc", "wf", "wc"}
    assert nmt.TASK.metrics[0] == "test_bleu"


@pytest.mark.parametrize("variant", sorted(nmt.VARIANT_PRESETS))
def test_every_soft_and_bam_variant_trains_with_its_preset(variant):
    """One SVI step of each soft/BAM variant at its preset: a finite loss that moves the weights;
    variants with a prior get exactly one attention site."""
    run = settings(variant)
    trainable = nmt.build_trainable(run, 30)
    model = trainable.model
    trainer = SVITrainer(model, trainable.guide, nmt.make_optimizer(run, model), elbo=trainable.elbo)
    g = torch.Generator().manual_seed(0)
    pairs = [torch.randint(4, 30, (n,), generator=g).numpy() for n in (3, 5, 4, 2)]
    args, kwargs = make_batch(pairs, pairs[::-1]).model_args
    before = [p.detach().clone() for p in model.parameters()]
    assert math.isfinite(trainer.step(*args, **kwargs))
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert model.num_sites == (run.attention.prior is not None)


@pytest.mark.parametrize("changes, message", [
    ({"variant": "gumbel"}, "variant must be one of the translation variants"),
    ({"preset": "gpu"}, "preset must be one of"),
    ({"batch_size": 0}, "batch_size must be a whole number >= 1"),
    ({"max_length": -3}, "max_length must be a whole number >= 1"),
    ({"lr": 0.0}, "lr must be a finite number > 0"),
    ({"length_penalty": -1.0}, "length_penalty must be a finite number >= 0"),
    ({"uncertainty_draws": 1}, "uncertainty_draws must be 0"),
    ({"dataset": "wmt"}, "dataset must be 'multi30k'"),
    ({"variant": "va-relaxed", "jensen_epochs": 15}, r"jensen_epochs must be none or a whole number below max_epochs \(15\)"),
    ({"variant": "va-sample", "jensen_epochs": 2}, "jensen_epochs must be unset for any variant but va-relaxed"),
])
def test_bad_settings_are_named(changes, message):
    with pytest.raises(ValueError, match=message):
        nmt.NmtSettings(**changes)


def test_missing_corpus_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"Multi30k train: missing train\.de\.gz, train\.en\.gz"):
        nmt.load_data(settings(), str(tmp_path))


class SourceCopier(torch.nn.Module):
    """A stand-in translator that outputs its source piece by piece, then EOS (its decoder state is
    the position)."""

    @property
    def network(self):
        return self

    def encode(self, src, src_mask):
        return Memory(src[..., None].float(), src[..., None].float(), src_mask)

    def initial_state(self, memory):
        position = torch.zeros(memory.mask.size(0), dtype=torch.long)
        return DecoderState((position,), (position,), position[:, None].float())

    def step(self, memory, state, tokens):
        position = state.hidden[0]
        return DecoderOutputs(position, memory.mask.float(), state.feed), DecoderState((position + 1,), state.cell, state.feed)

    def next_token_log_probs(self, memory, outputs):
        position = outputs.states
        within = position < memory.mask.sum(-1)
        ids = memory.states[torch.arange(position.size(0)), position.clamp(max=memory.mask.size(1) - 1), 0].long()
        ids = torch.where(within, ids, torch.full_like(ids, EOS))
        return torch.full((ids.size(0), 200), -1e9).scatter(-1, ids[:, None], 0.0)


def test_translations_are_detokenized_in_file_order_and_scored_against_raw_references(tmp_path):
    """On a corpus whose sources are their references, copying the source is a perfect translation."""
    root = write_corpus(tmp_path / "copy", sizes=(300, 30, 30), copy=True)
    data = nmt.load_data(settings(), str(root))
    for split in (data.val, data.test):
        translations = nmt.translate(SourceCopier(), data, split, beam_size=3, length_penalty=1.0, batch_size=7)
        assert translations == split.references
        assert nmt.bleu(translations, split.references) == pytest.approx(100.0)


def test_a_run_reports_its_metrics_and_writes_the_attention_posterior(toy_root, tmp_path):
    run = settings("wc", lr=1e-2, uncertainty_draws=20, max_train=128)
    data = nmt.load_data(run, str(toy_root))
    ctx = context(tmp_path, run)
    metrics = nmt.train_run(run, data, ctx)
    assert set(metrics) >= {"test_bleu", "test_ppl", "val_bleu", "val_ppl", "seconds_per_step", "parameters"}
    assert ctx.fit_result.epochs == 2 and metrics["val_ppl"] < data.vocab_size / 2  # better than uniform
    assert metrics["parameters"] == sum(p.numel() for p in nmt.build_trainable(run, data.vocab_size).model.parameters())
    assert 0 < metrics["seconds_per_step"] < 5 and 0 <= metrics["test_bleu"] <= 100
    for split in ("val", "test"):  # the scored output, kept: BLEU recomputed from the file is the record's
        lines = (tmp_path / "translations" / f"{split}.en").read_text(encoding="utf-8").split("\n")[:-1]
        references = getattr(data, split).references
        assert len(lines) == len(references) and nmt.bleu(lines, references) == metrics[f"{split}_bleu"]
    assert (tmp_path / "figures" / "attention.png").stat().st_size > 10_000
    assert (tmp_path / "diagnostics" / "attention.nc").is_file()
    summary = pd.read_csv(tmp_path / "diagnostics" / "attention-summary.csv")
    assert {"mean", "sd", "hdi_3%", "hdi_97%", "ess_bulk", "r_hat"} <= set(summary.columns)
    # independent draws: R-hat near 1 and ESS near the number of draws (2 chains of 20)
    assert len(summary) > 0 and abs(summary["r_hat"].median() - 1) < 0.05 and summary["ess_bulk"].median() > 20
    for variant in ("soft", "nokl"):  # no posterior beside a prior: soft's is its weights, nokl has no prior
        quick = settings(variant, max_epochs=1, uncertainty_draws=20, max_train=32)
        nmt.train_run(quick, data, context(tmp_path / variant, quick))
        assert not (tmp_path / variant / "diagnostics").exists()


@pytest.mark.parametrize("variant", ["va-sample", "va-relaxed"])
def test_variational_attention_writes_its_alignment_posterior_beside_the_prior(toy_root, tmp_path, variant):
    """q(z | x, y) from the inference network, drawn by Predictive over model and guide: the
    posterior mean is a distribution over each step's valid sources; the prior is the model's
    attention p(z | x, y_<j), which the inference network's q differs from."""
    run = settings(variant, lr=1e-2, max_epochs=1, uncertainty_draws=20, max_train=64)
    data = nmt.load_data(run, str(toy_root))
    nmt.train_run(run, data, context(tmp_path, run))
    assert (tmp_path / "figures" / "attention.png").stat().st_size > 10_000
    draws = az.from_netcdf(tmp_path / "diagnostics" / "attention.nc")
    posterior = draws.posterior["attention"].values  # [chain, draw, head, query, key], NaN where padded
    prior = draws.prior["attention"].values
    assert posterior.shape[:2] == (2, 20)
    rows = np.nansum(posterior.mean((0, 1)), -1)
    np.testing.assert_allclose(rows[rows > 0], 1.0, rtol=1e-5)  # padded query rows are all NaN: sum 0
    if variant == "va-sample":  # one-hot draws of a categorical alignment
        assert set(np.unique(posterior[~np.isnan(posterior)])) <= {0.0, 1.0}
    assert np.array_equal(np.isnan(prior[0, 0]), np.isnan(posterior[0, 0]))  # the same valid entries


def test_alignment_draws_follow_the_inference_networks_q_not_the_models_attention():
    torch.manual_seed(0)
    model = build_alignment_model("va-sample").eval()
    with torch.no_grad():
        model.inference.bilinear.weight.mul_(300.0)  # a sharp q, far from the model's near-uniform attention
    src, src_mask, tgt_in, tgt_mask, tgt_out = toy_batch()
    batch = ParallelBatch(src, src_mask, tgt_in, tgt_out, tgt_mask)
    posterior, prior = (d.numpy() for d in alignment_draws(model, batch, draws=4000))
    args, kwargs = batch.model_args
    q = poutine.trace(guide_for(model)).get_trace(*args, **kwargs).nodes[ALIGNMENT]["fn"].probs.detach().numpy()
    memory = model.network.encode(src, src_mask)
    attention = masked_scores(model.network.decoder_states(memory, tgt_in).scores, src_mask.unsqueeze(-2)).softmax(-1)
    valid = (tgt_mask[:, :, None] & src_mask[:, None, :]).numpy()
    np.testing.assert_allclose(prior[valid], attention.detach().numpy()[valid], rtol=1e-5)
    assert np.abs(posterior.mean(0) - q)[valid].max() < 0.04  # Monte Carlo sd at most 0.008
    assert np.abs(q - prior)[valid].max() > 0.2  # so the draws are q's, not the prior's


@pytest.mark.parametrize("variant", ["exact", "hard"])
def test_alignment_draws_of_a_model_without_inference_network_follow_its_exact_posterior(variant):
    """p(z_j | x, y_<=j) proportional to p(z_j | x, y_<j) p(y_j | x, y_<j, z_j), by hand from the
    network's tables, against the frequencies of the draws (infer_discrete over the enumerated site)."""
    torch.manual_seed(0)
    model = build_alignment_model(variant).eval()
    with torch.no_grad():
        model.network.output.weight.mul_(20.0)  # tokens that pin down their alignment: a posterior far from the prior
    src, src_mask, tgt_in, tgt_mask, tgt_out = toy_batch()
    batch = ParallelBatch(src, src_mask, tgt_in, tgt_out, tgt_mask)
    posterior, prior = (d.numpy() for d in alignment_draws(model, batch, draws=4000))
    with torch.no_grad():
        log_prior, log_likelihood, _, _ = network_tables(model, src, src_mask, tgt_in, tgt_out)
    exact = (log_prior + log_likelihood).softmax(-1).numpy()
    valid = (tgt_mask[:, :, None] & src_mask[:, None, :]).numpy()
    assert set(np.unique(posterior[:, valid])) <= {0.0, 1.0}  # one-hot draws
    np.testing.assert_allclose(prior[valid], log_prior.exp().numpy()[valid], rtol=1e-5)
    assert np.abs(posterior.mean(0) - exact)[valid].max() < 0.04  # Monte Carlo sd at most 0.008
    assert np.abs(exact - prior)[valid].max() > 0.2  # so the draws are the posterior's, not the prior's


class Crash(Exception):
    pass


def test_a_run_killed_inside_an_epoch_resumes_exactly(toy_root, tmp_path, monkeypatch):
    """Killed after 4 steps (one into the second epoch) with a checkpoint after every step, the
    resumed run ends with the parameters and scores of the uninterrupted one."""
    run = settings(max_train=96, max_epochs=2)  # 3 steps per epoch
    data = nmt.load_data(run, str(toy_root))
    straight = nmt.train_run(run, data, context(tmp_path / "straight", run))
    original, steps = EncodedSplit.training_batches, []

    def crashing(self, *args, **kwargs):
        for batch in original(self, *args, **kwargs):
            if len(steps) == 4:
                raise Crash
            steps.append(1)
            yield batch

    monkeypatch.setattr(EncodedSplit, "training_batches", crashing)
    with pytest.raises(Crash):
        nmt.train_run(run, data, context(tmp_path / "killed", run, checkpoint_seconds=0))
    monkeypatch.setattr(EncodedSplit, "training_batches", original)
    resumed = nmt.train_run(run, data, context(tmp_path / "killed", run, checkpoint_seconds=0))
    first, second = (torch.load(tmp_path / name / CHECKPOINT, weights_only=True) for name in ("straight", "killed"))
    assert first["epoch"] == second["epoch"] == 2
    for name, value in first["model"].items():
        assert torch.equal(value, second["model"][name]), name
    for name in ("test_bleu", "test_ppl", "val_bleu", "val_ppl"):
        assert straight[name] == resumed[name], name


def test_va_relaxed_fits_the_jensen_bound_for_its_first_epochs(toy_root, tmp_path):
    """Deng et al.'s warm start through the task: q = p for ``jensen_epochs`` epochs of SVI steps
    (by default a third of the budget), the inference network after them."""
    assert settings("va-relaxed", max_epochs=15).warm_epochs == 5 and settings("va-sample").warm_epochs == 0
    run = settings("va-relaxed", max_epochs=3, jensen_epochs=2, max_train=32, patience=5)
    data = nmt.load_data(run, str(toy_root))
    folder = context(tmp_path, run)
    nmt.train_run(run, data, folder)
    trainer = folder.trainers[-1]
    steps_per_epoch = data.train.num_batches(run.batch_size)
    assert trainer.guide.warm_steps == 2 * steps_per_epoch
    assert trainer.global_step == 3 * steps_per_epoch and not trainer.guide.warming(trainer.global_step)
    assert nmt.early_stopping(settings("va-relaxed", max_epochs=15)).start_epoch == 5  # no candidates before
    assert nmt.early_stopping(run).start_epoch == 2 and nmt.early_stopping(settings("soft")).start_epoch == 0


@pytest.mark.parametrize("variant", ["exact", "va-enum", "va-sample", "va-relaxed"])
def test_latent_alignment_variants_train_and_translate_through_the_task(variant, toy_root, tmp_path):
    """Each family of Deng et al.'s estimators (enumerated in the model, in the guide, sampled with a
    baseline, relaxed) trains and is scored by the task's own loop, with top-K prediction."""
    run = settings(variant, max_epochs=1, max_train=32, top_k=3, beam_size=2)
    data = nmt.load_data(run, str(toy_root))
    metrics = nmt.train_run(run, data, context(tmp_path, run))
    assert math.isfinite(metrics["test_ppl"]) and 0 <= metrics["test_bleu"] <= 100


# --- a finished run, loaded back -------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_runs(toy_root, tmp_path_factory):
    """A sweep's output folder holding a finished BAM-WC and a soft run (2 epochs of the tiny preset)."""
    out = tmp_path_factory.mktemp("sweep")
    nmt.main(["--variant", "wc", "soft", "--seeds", "0", "--preset", "tiny", "--bpe-size", "120", "--batch-size", "32",
              "--max-epochs", "2", "--beam-size", "2", "--eval-batch-size", "16", "--uncertainty-draws", "0",
              "--lr", "0.01", "--data-root", str(toy_root), "--out", str(out), "--no-progress",
              "--threads", "1"])
    return out / "runs"


def test_a_finished_run_loads_back_as_it_was_scored(finished_runs, toy_root, tmp_path):
    run_dir = finished_runs / "multi30k-wc-seed0"
    record = json.loads((run_dir / RECORD).read_text())
    loaded = load_trained(nmt.TASK, run_dir, str(toy_root))
    assert loaded.settings.row() == record["settings"] and not loaded.model.training
    val_ppl = record["metrics"]["val_ppl"]
    assert nmt.perplexity(loaded.model, loaded.data.val, 16) == pytest.approx(val_ppl, rel=1e-6)
    # the kept epoch's parameters, not the last ones: spoil the last ones and load again
    copy = tmp_path / "runs" / run_dir.name
    shutil.copytree(run_dir, copy)
    checkpoint = torch.load(copy / CHECKPOINT, weights_only=True)
    checkpoint["model"] = {name: torch.zeros_like(value) for name, value in checkpoint["model"].items()}
    torch.save(checkpoint, copy / CHECKPOINT)
    (copy / RECORD).write_text(json.dumps({**record, CHECKPOINT_SHA256: file_sha256(copy / CHECKPOINT)}))  # changed on purpose
    again = load_trained(nmt.TASK, copy, str(toy_root))
    assert nmt.perplexity(again.model, again.data.val, 16) == pytest.approx(val_ppl, rel=1e-6)


def test_loading_a_run_names_what_is_wrong(finished_runs, toy_root, tmp_path):
    from experiments.gat.task import TASK as GAT

    run_dir = finished_runs / "multi30k-wc-seed0"
    with pytest.raises(ValueError, match="is a run of task 'nmt', not 'gat'"):
        load_trained(GAT, run_dir)

    def broken(name: str, change) -> Path:
        copy = tmp_path / name / "runs" / run_dir.name
        shutil.copytree(run_dir, copy)
        change(copy)
        return copy

    def add_setting(folder: Path) -> None:
        record = json.loads((folder / RECORD).read_text())
        record["settings"]["colour"] = "red"
        (folder / RECORD).write_text(json.dumps(record))

    def other_seed(folder: Path) -> None:
        record = json.loads((folder / RECORD).read_text())
        record["settings"]["seed"] = 7
        (folder / RECORD).write_text(json.dumps(record))

    cases = {"unfinished": (lambda folder: (folder / RECORD).unlink(), "no record.json, an unfinished run"),
             "unknown": (add_setting, r"settings this version of nmt does not know: \['colour'\]"),
             "mismatch": (other_seed, r"checkpoint was written with other settings than its record: seed=0 \(this run: 7\)"),
             "no-checkpoint": (lambda folder: (folder / CHECKPOINT).unlink(), "no checkpoint.pt")}
    for name, (change, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            load_trained(nmt.TASK, broken(name, change), str(toy_root))
    with pytest.raises(ValueError, match="not a run folder"):
        load_trained(nmt.TASK, tmp_path / "nowhere", str(toy_root))


def test_attention_posterior_of_chosen_sentences_from_the_command_line(finished_runs, toy_root, tmp_path, capsys):
    """Sentences of a split by number, or a sentence of one's own with the model's translation as target."""
    run_dir = finished_runs / "multi30k-wc-seed0"
    common = ["--draws", "4", "--data-root", str(toy_root)]
    written = nmt_uncertainty.main([str(run_dir), "--split", "test", "--sentences", "3", "1", *common])
    assert written["figure"] == run_dir / "attention-test-3" / "figures" / "attention.png" and written["figure"].is_file()
    data = load_trained(nmt.TASK, run_dir, str(toy_root)).data
    summary = pd.read_csv(written["summary"])
    assert len(summary) == int(valid_entries(data.test.batch([3, 1])).sum())  # every entry of both
    printed = capsys.readouterr().out
    assert f"target:      {data.test.references[3]}" in printed  # the reference, drawn along

    source = "Zwei hund läuft auf dem rot katze."
    written = nmt_uncertainty.main([str(run_dir), "--source", source, "--out", str(tmp_path / "own"), *common])
    assert written["figure"] == tmp_path / "own" / "figures" / "attention.png" and written["figure"].is_file()
    lines = dict(line.split(":", 1) for line in capsys.readouterr().out.splitlines() if line.startswith(("source", "target", "translation")))
    assert lines["source"].strip() == source
    assert lines["target"].split(" (the attention")[0].strip() == lines["translation"].strip()  # its own translation

    for argv, message in (([str(run_dir), "--sentences", "99"], "sentence 99 is out of range: the split has 16"),
                          ([str(finished_runs / "multi30k-soft-seed0")], "variant 'soft' has no attention posterior"),
                          ([str(run_dir), "--target", "a dog."], "--target goes with --source")):
        with pytest.raises(SystemExit) as exit:
            nmt_uncertainty.main([*argv, *common])
        assert exit.value.code == 2 and message in capsys.readouterr().err


def test_search_errors_are_told_from_model_errors_on_the_objective_beam_search_maximizes(finished_runs, toy_root, tmp_path, capsys,
                                                                                           monkeypatch):
    from experiments.nmt import search as nmt_search
    from models.decoding import length_penalty_factor

    runs = [finished_runs / "multi30k-wc-seed0", finished_runs / "multi30k-soft-seed0"]
    table = nmt_search.main([*map(str, runs), "--sentences", "10", "--batch-size", "4", "--out", str(tmp_path / "search"),
                             "--data-root", str(toy_root)])
    assert list(table["run"]) == [r.name for r in runs] and (tmp_path / "search" / "figures" / "search.png").is_file()
    scores = pd.read_csv(tmp_path / "search" / "search.csv", keep_default_na=False)
    assert len(scores) == 20 and list(scores["sentence"][:10]) == list(range(10))

    settings, data, model = load_trained(nmt.TASK, runs[0], str(toy_root))
    split = nmt_search.first_sentences(data.val, 10)
    ours = scores[scores["run"] == runs[0].name].reset_index(drop=True)
    # the references' log-likelihoods are the task's perplexity on these sentences
    nll = -ours["reference_log_prob"].sum() / ours["reference_pieces"].sum()
    assert math.exp(nll) == pytest.approx(nmt.perplexity(model, split, 16), rel=1e-5)
    # the output's log-likelihood is its teacher-forced one: re-score each output as a target
    batch = split.batch(range(10))
    outputs = [np.asarray(h[0].tokens, dtype=np.int64) for h in
               beam_hypotheses(model, batch.src, batch.src_mask, BOS, EOS, settings.beam_size, settings.length_penalty)]
    assert list(ours["output"]) == [data.decode(o) for o in outputs]
    rescored = make_batch(split.sources, outputs)
    with torch.no_grad():
        log_probs = model.log_probs(*rescored.inputs).gather(-1, rescored.tgt_out.unsqueeze(-1)).squeeze(-1)
    expected = log_probs.masked_fill(~rescored.tgt_mask, 0.0).sum(-1)
    torch.testing.assert_close(torch.tensor(ours["output_log_prob"]), expected.double(), rtol=1e-4, atol=1e-4)
    assert list(ours["exact"]) == [a.tolist() == b.tolist() for a, b in zip(outputs, split.targets)]
    penalty = length_penalty_factor(torch.tensor(ours["output_pieces"], dtype=torch.float64), settings.length_penalty)
    torch.testing.assert_close(torch.tensor(ours["output_score"]), torch.tensor(ours["output_log_prob"]) / penalty)
    summary = table.iloc[0]
    assert summary["bleu"] == pytest.approx(nmt.bleu(list(ours["output"]), split.references))
    assert summary["search_errors_%"] == pytest.approx(100 * (ours["reference_score"] > ours["output_score"]).mean())

    # again, with the runs kept: nothing is loaded or decoded, the same table comes out
    monkeypatch.setattr(nmt_search, "load_trained", lambda *args: pytest.fail("a kept run was scored again"))
    again = nmt_search.main([*map(str, runs), "--sentences", "10", "--out", str(tmp_path / "search"), "--data-root", str(toy_root)])
    pd.testing.assert_frame_equal(again, table)

    with pytest.raises(SystemExit) as exit:
        nmt_search.main([str(runs[0]), "--sentences", "0", "--data-root", str(toy_root)])
    assert exit.value.code == 2 and "--sentences and --batch-size must be at least 1" in capsys.readouterr().err


def test_search_error_and_model_error_shares_by_hand():
    from experiments.nmt.search import run_summary

    scores = pd.DataFrame({
        "reference_log_prob": [-2.0, -9.0, -4.0, -1.0], "reference_pieces": [2, 3, 4, 1],
        "reference_score": [-1.0, -3.0, -1.0, -1.0],
        "output_log_prob": [-2.0, -2.0, -6.0, -1.0], "output_pieces": [2, 2, 3, 1],
        "output_score": [-1.0, -1.0, -2.0, -1.0],
        "exact": [True, False, False, True],
        "output": ["a dog runs", "a cat", "two men sit", "hello"],
        "reference": ["a dog runs", "a dog sleeps", "two men are sitting", "hello"],
    })
    summary = run_summary(scores)
    assert summary["search_errors_%"] == 25.0  # only the third: its reference scores -1 against -2
    assert summary["model_errors_%"] == 25.0  # the second: the model prefers its wrong output
    assert summary["exact_%"] == 50.0
    assert summary["reference_nll_per_piece"] == pytest.approx(16 / 10)
    assert summary["output_nll_per_piece"] == pytest.approx(11 / 8)
    assert summary["length_ratio"] == pytest.approx(9 / 11)  # words: 3 + 2 + 3 + 1 against 3 + 3 + 4 + 1
