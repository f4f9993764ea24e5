"""The SVI loop: exact resume from a checkpoint, the early-stopping rule, and a real Cora run."""

import time

import pytest
import torch

from bam_pyro import BamConfig, ObjectiveConfig
from bam_pyro.training import Diverged, EarlyStopping, SVITrainer, seed_everything
from experiments.gat.task import TASK, train
from experiments.runner import RunContext, build_parser
from bam_pyro import AttentionGuide
from models.gat import build_node_classifier

from .conftest import random_graph


def make_trainer(checkpoint=None):
    seed_everything(0)
    x, edge_index, y = random_graph(num_nodes=40, num_edges=160)
    model = build_node_classifier(x.size(1), 3, BamConfig("wc", k=2.0), ObjectiveConfig(anneal_rate=0.3), dropout=0.5)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    trainer = SVITrainer(model, AttentionGuide(model.model), optimizer, checkpoint=checkpoint, checkpoint_every=3)
    batch = ((x, edge_index), dict(y=y, nodes=torch.arange(20)))

    def evaluate():
        logits = model.network(x, edge_index)
        return {"val_loss": torch.nn.functional.cross_entropy(logits[20:], y[20:]).item()}

    return trainer, (lambda: [batch]), evaluate


def test_resume_from_checkpoint_matches_uninterrupted_run(tmp_path):
    trainer, batches, evaluate = make_trainer()
    trainer.fit(batches, evaluate, max_epochs=10, progress=False)
    uninterrupted = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    checkpoint = tmp_path / "run.pt"
    first, batches, evaluate = make_trainer(checkpoint)
    before = first.fit(batches, evaluate, max_epochs=6, progress=False)  # "crash" after 6 epochs
    torch.manual_seed(12345)  # whatever happens to the RNG in between must not matter
    resumed, batches, evaluate = make_trainer(checkpoint)  # a fresh process would rebuild everything
    start = time.perf_counter()
    result = resumed.fit(batches, evaluate, max_epochs=10, progress=False)
    assert before.seconds < result.seconds <= before.seconds + time.perf_counter() - start  # the whole run's time
    assert result.epochs == 10 and len(result.history) == 10
    finished, batches, evaluate = make_trainer(checkpoint)  # resuming a finished run trains no more
    assert finished.fit(batches, evaluate, max_epochs=10, progress=False).seconds >= result.seconds
    assert resumed.global_step == 10
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, uninterrupted[name]), name
    assert resumed.history == trainer.history


def test_resume_with_early_stopping_matches_uninterrupted_run(tmp_path):
    """Interrupted while early stopping is counting, the resumed run stops at the same epoch with
    the same best parameters: the patience count and the best metrics come from the checkpoint."""
    def fit(checkpoint, max_epochs):
        trainer, batches, evaluate = make_trainer(checkpoint)
        stopping = EarlyStopping({"val_loss": "min"}, patience=2)
        result = trainer.fit(batches, evaluate, max_epochs=max_epochs, early_stopping=stopping, progress=False)
        return trainer, result, stopping

    reference, uninterrupted, _ = fit(None, 12)
    assert uninterrupted.stopped_early
    checkpoint = tmp_path / "run.pt"
    _, _, interrupted = fit(checkpoint, 4)
    assert interrupted.waited > 0  # the crash falls while early stopping waits
    resumed, result, _ = fit(checkpoint, 12)
    assert (result.epochs, result.best_epoch, result.stopped_early) == (
        uninterrupted.epochs, uninterrupted.best_epoch, uninterrupted.stopped_early
    )
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, reference.model.state_dict()[name]), name


class Crash(Exception):
    """Stands in for a kill between two steps."""


def shuffled_minibatch_trainer(checkpoint=None, crash_after=None):
    """A trainer whose epochs are 6 minibatches drawn from the *global* torch RNG (as a shuffling
    DataLoader draws them), checkpointing between every two steps (``checkpoint_seconds=0``);
    ``crash_after``: raise :class:`Crash` once that many steps have run in this process."""
    trainer, _, evaluate = make_trainer(checkpoint)
    trainer.checkpoint_seconds = 0.0
    x, edge_index, y = random_graph(num_nodes=40, num_edges=160)
    steps = 0

    def batches():
        nonlocal steps
        for nodes in torch.randperm(30).split(5):
            if crash_after is not None and steps == crash_after:
                raise Crash
            steps += 1
            yield (x, edge_index), dict(y=y, nodes=nodes)

    return trainer, batches, evaluate


def trained_and_crashed_after_nine_steps(tmp_path):
    """An uninterrupted 3-epoch run, and the checkpoint of the same run killed after its 9th step."""
    reference, batches, evaluate = shuffled_minibatch_trainer()
    reference.fit(batches, evaluate, max_epochs=3, progress=False)
    checkpoint = tmp_path / "run.pt"
    crashed, batches, evaluate = shuffled_minibatch_trainer(checkpoint, crash_after=9)
    with pytest.raises(Crash):
        crashed.fit(batches, evaluate, max_epochs=3, progress=False)
    return reference, checkpoint


def resumed_to_the_end(reference, checkpoint):
    """The run resumed from ``checkpoint``, checked to end bit-for-bit where ``reference`` ends."""
    resumed, batches, evaluate = shuffled_minibatch_trainer(checkpoint)
    resumed.fit(batches, evaluate, max_epochs=3, progress=False)
    assert resumed.global_step == 18
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, reference.model.state_dict()[name]), name
    return resumed


def test_resume_inside_an_epoch_matches_uninterrupted_run(tmp_path):
    """Killed after the 9th step (3 into the second epoch), the resumed run rebuilds the epoch's
    shuffle from the RNG state it began with, skips the 3 batches done and ends bit-for-bit where
    the uninterrupted run ends; the checkpoint reads back with weights_only=True."""
    reference, checkpoint = trained_and_crashed_after_nine_steps(tmp_path)
    state = torch.load(checkpoint, weights_only=True)
    assert (state["epoch"], state["step_in_epoch"], len(state["epoch_losses"])) == (1, 3, 3)
    torch.manual_seed(12345)
    resumed = resumed_to_the_end(reference, checkpoint)
    assert resumed.history == reference.history  # the second epoch's loss averages all 6 steps


def test_a_checkpoint_whose_model_kept_the_step_as_a_buffer_resumes_at_its_step(tmp_path):
    """Checkpoints written while ``BamModel`` kept the annealing step as a buffer hold it in the
    model's state dict (``model.step``) and no ``global_step``: the run resumes at that step (the
    annealed KL weight of every later step depends on it), and ends bit-for-bit where the
    uninterrupted run ends."""
    reference, checkpoint = trained_and_crashed_after_nine_steps(tmp_path)
    state = torch.load(checkpoint, weights_only=True)
    state["model"]["step"] = torch.tensor(state.pop("global_step"))  # the earlier format
    torch.save(state, checkpoint)
    resumed_to_the_end(reference, checkpoint)


def test_a_checkpoint_of_other_settings_is_refused_by_name(tmp_path):
    checkpoint = tmp_path / "run.pt"
    trainer, batches, evaluate = make_trainer(checkpoint)
    trainer.metadata = {"k": 2.0, "lr": 0.01}
    trainer.fit(batches, evaluate, max_epochs=1, progress=False)
    other, batches, evaluate = make_trainer(checkpoint)
    other.metadata = {"k": 3.0, "lr": 0.01}
    with pytest.raises(ValueError, match=r"other settings: k=2.0 \(this run: 3.0\)"):
        other.fit(batches, evaluate, max_epochs=2, progress=False)


def test_early_stopping_resets_on_any_improvement_and_keeps_the_best_of_all():
    model = torch.nn.Linear(1, 1)
    stop = EarlyStopping({"loss": "min", "acc": "max"}, patience=2)
    assert not stop.update({"loss": 1.0, "acc": 0.5}, 0, model)
    assert stop.best_epoch == 0
    assert not stop.update({"loss": 0.9, "acc": 0.4}, 1, model)  # loss improves only: patience resets
    assert stop.best_epoch == 0 and stop.waited == 0
    assert not stop.update({"loss": 0.8, "acc": 0.6}, 2, model)  # both improve: new best
    assert stop.best_epoch == 2
    assert not stop.update({"loss": 0.85, "acc": 0.55}, 3, model)
    assert stop.update({"loss": 0.9, "acc": 0.5}, 4, model)  # two epochs without improvement
    with pytest.raises(KeyError, match="acc"):
        stop.update({"loss": 0.1}, 5, model)


def test_early_stopping_neither_keeps_nor_counts_the_epochs_before_its_start():
    model = torch.nn.Linear(1, 1)
    stop = EarlyStopping({"loss": "min"}, patience=1, start_epoch=2)
    assert not stop.update({"loss": 0.1}, 0, model) and not stop.update({"loss": 0.2}, 1, model)  # warm-up
    assert stop.best_epoch == -1 and stop.best_state is None and stop.waited == 0
    assert not stop.update({"loss": 0.5}, 2, model)  # worse than the warm-up, still the first candidate
    assert stop.best_epoch == 2 and stop.best == {"loss": 0.5}
    assert stop.update({"loss": 0.6}, 3, model)
    with pytest.raises(ValueError, match="start_epoch must be >= 0"):
        EarlyStopping({"loss": "min"}, start_epoch=-1)


def test_non_finite_loss_raises_a_clear_error():
    trainer, batches, _ = make_trainer()

    class DivergedELBO:
        def differentiable_loss(self, model, guide, *args, **kwargs):
            return torch.tensor(float("nan"), requires_grad=True)

    trainer.elbo = DivergedELBO()
    (args, kwargs), = batches()
    with pytest.raises(Diverged, match="non-finite loss nan at step 0"):
        trainer.step(*args, **kwargs)


@pytest.mark.parametrize("variant", ["wc"])
def test_short_cora_run_learns(cora, variant, tmp_path):
    data, num_features, num_classes = cora
    settings = TASK.settings_for("cora", variant, 0, dict(max_epochs=60, patience=60))
    row = train(settings, cora, RunContext(tmp_path, settings, progress=False))
    assert row["val_acc"] > 70.0  # chance is ~14% (7 classes), the majority class ~30%
    assert row["test_acc"] > 70.0


def test_gat_overrides_reach_the_config_and_the_row():
    parser, names = build_parser(TASK)
    args = parser.parse_args(["--k", "10", "--detach-prior-keys", "--prior-scope", "all_keys"])
    settings = TASK.settings_for("citeseer", "wc", 0, {name: getattr(args, name) for name in names})
    assert settings.attention.k == 10.0 and settings.attention.detach_prior_keys is True
    assert settings.attention.prior_scope == "all_keys" and settings.row()["k"] == 10.0
    assert settings.attention.beta == 1e-15  # the rest of the CiteSeer preset holds


def test_rng_state_round_trips_and_carries_the_cuda_streams_once_cuda_is_in_use(monkeypatch):
    """A checkpoint written on a GPU must restore the device's generators too (dropout and attention
    noise are drawn there), or resume is silently not exact; CUDA is simulated here."""
    import random

    import numpy as np

    from bam_pyro.training import rng_state, set_rng_state

    seed_everything(3)
    saved = rng_state()
    first = (random.random(), np.random.rand(), torch.rand(2))
    set_rng_state(saved)
    assert (random.random(), np.random.rand()) == first[:2] and torch.equal(torch.rand(2), first[2])
    assert "cuda" not in saved

    streams = [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([3, 4], dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: streams)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.extend)
    saved = rng_state()
    assert saved["cuda"] is streams
    set_rng_state(saved)
    assert restored == streams


def test_a_checkpoint_resumes_only_under_settings_it_records_alike():
    """The checkpoint's settings check is the record's: a setting the checkpoint lacks may have had
    any value (it predates the setting), and True is not 1; 1 and 1.0, NaN and NaN are alike."""
    from bam_pyro.training import metadata_differences

    assert metadata_differences({"lr": 0.1}, {"lr": 0.1, "cap": None}) == ["cap='absent' (this run: None)"]
    assert metadata_differences({"flag": True}, {"flag": 1}) == ["flag=True (this run: 1)"]
    assert metadata_differences({"lr": 1, "x": float("nan")}, {"lr": 1.0, "x": float("nan")}) == []


def test_early_stopping_refuses_a_nan_metric_that_no_later_epoch_could_beat():
    stopping = EarlyStopping({"val_loss": "min"}, patience=2)
    model = torch.nn.Linear(1, 1)
    stopping.update({"val_loss": 1.0}, 0, model)
    with pytest.raises(Diverged, match="epoch 1: the monitored val_loss is NaN"):
        stopping.update({"val_loss": float("nan")}, 1, model)
    assert stopping.best_epoch == 0
