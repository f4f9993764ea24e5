"""A BAM-converted transformers model saved with ``save_pretrained`` loads back, in a fresh process
and one call, as the same Bayesian-attention model."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from bam_pyro import BamConfig, ObjectiveConfig
from bam_pyro.transformers import build_sequence_model, from_pretrained, to_bam

WC = BamConfig("wc", k=10.0, beta=1e-2, d_mid=5)
REPOSITORY = Path(__file__).resolve().parents[1]

LOAD_IN_A_FRESH_PROCESS = """
import sys, torch
from bam_pyro.transformers import from_pretrained

folder, expected = sys.argv[1], torch.load(sys.argv[2])
model = from_pretrained(folder).eval()
assert model.config._attn_implementation == "bam", model.config._attn_implementation
priors = {n: p for n, p in model.state_dict().items() if ".prior_net." in n}
assert priors.keys() == expected["priors"].keys(), sorted(priors)
assert all(torch.equal(priors[n], p) for n, p in expected["priors"].items())
with torch.no_grad():
    logits = model(**expected["inputs"]).logits
torch.testing.assert_close(logits, expected["logits"], atol=1e-6, rtol=1e-6)
print("loaded", type(model).__name__)
"""


@pytest.fixture(scope="module")
def saved_bam(tiny_bert_folder, tmp_path_factory):
    """A tiny BERT converted with WC, its prior networks moved off their initialization, saved."""
    model = to_bam(AutoModelForSequenceClassification.from_pretrained(tiny_bert_folder), WC)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".prior_net." in name:
                parameter.add_(torch.randn_like(parameter))
    folder = tmp_path_factory.mktemp("bam-bert")
    model.save_pretrained(folder)
    return folder, model.eval()


def test_a_saved_model_loads_back_as_bam_in_a_fresh_process(saved_bam, tmp_path):
    folder, model = saved_bam
    ids = torch.randint(1000, 2000, (2, 6))
    inputs = {"input_ids": ids, "attention_mask": torch.tensor([[1] * 6, [1] * 4 + [0] * 2])}
    with torch.no_grad():
        logits = model(**inputs).logits
    priors = {n: p for n, p in model.state_dict().items() if ".prior_net." in n}
    assert len(priors) == 6
    torch.save({"priors": priors, "inputs": inputs, "logits": logits}, tmp_path / "expected.pt")
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY)}
    run = subprocess.run([sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS, str(folder), str(tmp_path / "expected.pt")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "loaded BertForSequenceClassification" in run.stdout


def test_build_sequence_model_keeps_saved_priors_and_refuses_another_config(saved_bam):
    folder, model = saved_bam
    bam_model = build_sequence_model(str(folder), 2, WC, ObjectiveConfig())
    loaded = bam_model.network.model.state_dict()
    assert all(torch.equal(loaded[n], p) for n, p in model.state_dict().items())
    with pytest.raises(ValueError, match="not the requested"):
        build_sequence_model(str(folder), 2, WC.replace(k=5.0), ObjectiveConfig())


def test_a_bam_model_loaded_by_plain_transformers_is_refused(saved_bam):
    """transformers' own from_pretrained drops the priors (unexpected keys) and comes back with
    sdpa attention; such a model cannot pass for the saved one."""
    folder, _ = saved_bam
    plain = AutoModelForSequenceClassification.from_pretrained(folder)
    with pytest.raises(ValueError, match="bam_pyro.transformers.from_pretrained"):
        build_sequence_model(plain, 2, WC, ObjectiveConfig())
    with pytest.raises(ValueError, match="drops its trained priors"):  # new random priors would replace them
        to_bam(plain, WC)
    with pytest.raises(ValueError, match="already has Bayesian attention"):
        to_bam(from_pretrained(folder), WC)


def test_an_unconverted_model_is_refused(tiny_bert_folder):
    with pytest.raises(ValueError, match="holds no Bayesian attention"):
        from_pretrained(tiny_bert_folder)
