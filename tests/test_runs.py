"""A results folder resumes a sweep and never passes one setting's result off as another's."""

import pytest

from experiments.gat import settings_for
from experiments.runs import ResultsFile


def test_finished_run_is_found_again_after_a_restart(tmp_path):
    settings = settings_for("cora", "wc", 0, {}).row()
    results = ResultsFile(tmp_path, ("dataset", "variant", "seed"))
    assert not results.has(settings)
    results.add({**settings, "test_acc": 80.0})
    reopened = ResultsFile(tmp_path, ("dataset", "variant", "seed"))  # read back from the CSV
    assert reopened.has(settings)
    assert not reopened.has(settings_for("cora", "wc", 1, {}).row())


def test_same_run_with_other_settings_is_refused_by_name(tmp_path):
    ResultsFile(tmp_path, ("dataset", "variant", "seed")).add({**settings_for("cora", "wc", 0, {}).row(), "test_acc": 80.0})
    reopened = ResultsFile(tmp_path, ("dataset", "variant", "seed"))
    for override, field in (({"k": 10.0}, "k="), ({"detach_prior_keys": True}, "detach_prior_keys="), ({"patience": 5}, "patience=")):
        with pytest.raises(ValueError, match=field):
            reopened.has(settings_for("cora", "wc", 0, override).row())


def test_checkpoint_name_changes_with_any_setting(tmp_path):
    results = ResultsFile(tmp_path, ("dataset", "variant", "seed"))
    preset = results.checkpoint(settings_for("cora", "wc", 0, {}).row())
    assert preset == results.checkpoint(settings_for("cora", "wc", 0, {}).row())
    assert preset.name.startswith("cora-wc-0-") and preset.parent == tmp_path / "checkpoints"
    assert preset != results.checkpoint(settings_for("cora", "wc", 0, {"beta": 1e-9}).row())
