"""Bad input fails early with an error that names the problem."""

import pytest
import torch

from bam_pyro import (AttentionGuide, BamConfig, BayesianAttention, DenseKeys, MultiHeadBayesianAttention, ObjectiveConfig,
                      attention_sites)
from bam_pyro.pyg import EdgeKeys
from experiments.data_root import require_files
from experiments.bench import main as bench_main
from experiments.gat.task import TASK as GAT
from experiments.gat.task import main as gat_main
from experiments.glue.task import TASK as GLUE
from experiments.gat.planetoid import load_planetoid
from bam_pyro.pyg import validate_graph
from bam_pyro.training import DamagedFile, read_checkpoint
from bam_pyro.transformers import resolve_pretrained

from .conftest import random_graph


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(variant="wcx"), "unknown BAM variant 'wcx'"),
        (dict(k=0.0), "k must be a finite number > 0"),
        (dict(beta=-1e-10), "beta must be a finite number > 0"),
        (dict(sigma_q=float("nan")), "sigma_q must be a finite number > 0"),
        (dict(sigma_q=14.0), "sigma_q must be <= 10.0, got 14.0: q's samples .* underflow"),
        (dict(alpha=float("inf")), "alpha must be a finite number > 0"),
        (dict(d_mid=0), "d_mid must be a whole number >= 1"),
        (dict(d_mid=2.5), "d_mid must be a whole number >= 1"),
        (dict(detach_prior_keys="yes"), "detach_prior_keys must be True or False"),
        (dict(gamma_shape="psi*beta"), "gamma_shape must be one of \\('psi_beta', 'psi'\\)"),
        (dict(prior_scope="graph"), "prior_scope must be one of \\('query_keys', 'all_keys'\\)"),
    ],
)
def test_invalid_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BamConfig(**kwargs)


def test_invalid_objective():
    with pytest.raises(ValueError, match="reduction must be"):
        ObjectiveConfig(reduction="avg")
    with pytest.raises(ValueError, match="anneal_rate must be a finite number > 0"):
        ObjectiveConfig(anneal_rate=0.0)
    with pytest.raises(TypeError, match="kl_weight must be a number"):
        ObjectiveConfig(kl_weight="1")


def test_nan_features_are_named():
    x, edge_index, _ = random_graph()
    x[3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"NaN or inf at 1 nodes \(first: \[3\]\)"):
        validate_graph(x, edge_index)


def test_wrong_shapes_are_named():
    x, edge_index, _ = random_graph()
    with pytest.raises(ValueError, match="node features must have shape"):
        validate_graph(x[None], edge_index)
    with pytest.raises(ValueError, match="edge_index must be a LongTensor of shape"):
        validate_graph(x, edge_index.t())
    with pytest.raises(ValueError, match="outside"):
        validate_graph(x, edge_index + 1000)
    with pytest.raises(ValueError, match="edge_index must have shape"):
        EdgeKeys(edge_index.t(), 30)
    with pytest.raises(TypeError, match="attention mask must be boolean"):
        DenseKeys(torch.ones(1, 1, 1, 4))
    attn = MultiHeadBayesianAttention(8, 2, BamConfig("wc"))
    with pytest.raises(ValueError, match=r"^valid_keys of shape \(1, 3\) does not fit key of shape \(1, 4, 8\): expected \[1, 4\] or \[4\]"):
        attn(torch.randn(1, 4, 8), torch.randn(1, 4, 8), torch.randn(1, 4, 8), valid_keys=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="not divisible"):
        MultiHeadBayesianAttention(10, 3, BamConfig("wc"))


def test_missing_pubmed_file_is_named_with_its_folder(data_root):
    with pytest.raises(FileNotFoundError, match=r"missing .*ind\.pubmed\.allx.* in .*planetoid/PubMed/raw"):
        load_planetoid("pubmed", data_root)


def test_missing_data_root_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing ind\.cora\.x, .* in " + str(tmp_path)):
        load_planetoid("cora", tmp_path)
    with pytest.raises(FileNotFoundError, match="BAM_DATA"):
        require_files(tmp_path, ["a.tsv"], "GLUE RTE")


def test_unknown_dataset_and_variant_on_the_command_line():
    with pytest.raises(SystemExit):
        gat_main(["--dataset", "pubmedx"])
    with pytest.raises(SystemExit):
        gat_main(["--variant", "wcc"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(max_train=0), "max_train must be a finite number >= 1, got 0"),
        (dict(epochs=0), "epochs must be a finite number >= 1"),
        (dict(lr=-1e-5), "lr must be a finite number > 0"),
        (dict(weight_decay=-0.1), "weight_decay must be a finite number >= 0"),
        (dict(warmup=1.0), r"warmup must be a fraction of the steps in \[0, 1\)"),
    ],
)
def test_invalid_finetuning_settings_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        GLUE.settings_for("rte", "wc", 0, overrides)


def test_invalid_training_settings_are_named():
    with pytest.raises(ValueError, match="max_epochs must be a finite number >= 1, got 0"):
        GAT.settings_for("cora", "wc", 0, {"max_epochs": 0})
    with pytest.raises(ValueError, match="lr must be a finite number > 0"):
        GAT.settings_for("cora", "soft", 0, {"lr": float("nan")})


def test_a_missing_model_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no model folder at {tmp_path / 'minilm'}"):
        resolve_pretrained(str(tmp_path / "minilm"))
    assert resolve_pretrained("albert-base-v2") == "albert-base-v2"  # a hub name is passed on
    assert resolve_pretrained(str(tmp_path)) == str(tmp_path)


def test_invalid_benchmark_sizes_are_named(capsys):
    with pytest.raises(SystemExit):
        bench_main(["gat", "--nodes", "100", "--edges", "0"])
    assert "argument --edges: must be at least 1, got 0" in capsys.readouterr().err


def test_negative_seeds_are_named(tmp_path, capsys):
    with pytest.raises(SystemExit):  # refused while parsing: no data root is needed
        gat_main(["--seeds", "0", "-1", "--data-root", str(tmp_path), "--out", str(tmp_path / "out")])
    assert "argument --seeds: must be at least 0, got -1" in capsys.readouterr().err


def test_planetoid_nan_is_named_at_its_raw_node_and_a_fixed_file_is_read_again(tmp_path, data_root, monkeypatch):
    import pickle
    import shutil

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # PyG's processed copies
    raw = tmp_path / "root" / "planetoid" / "Cora" / "raw"
    shutil.copytree(data_root / "planetoid" / "Cora" / "raw", raw)
    allx = raw / "ind.cora.allx"  # the features of nodes 0..1707
    original = allx.read_bytes()
    features = pickle.loads(original, encoding="latin1").tolil()
    features[3, 0] = float("nan")
    allx.write_bytes(pickle.dumps(features.tocsr()))
    with pytest.raises(ValueError, match=r"NaN or inf at 1 nodes \(first: \[3\]\)"):  # not all 2708 after normalizing
        load_planetoid("cora", tmp_path / "root")
    allx.write_bytes(original)  # fixed: the processed copy of the broken file must not be used
    data, _, _ = load_planetoid("cora", tmp_path / "root")
    assert torch.isfinite(data.x).all()


def test_attention_constructors_name_bad_arguments():
    with pytest.raises(ValueError, match="num_heads must be a whole number >= 1, got 0"):
        MultiHeadBayesianAttention(32, 0, BamConfig("wc"))
    with pytest.raises(ValueError, match="d_model must be a whole number >= 1, got 0"):
        MultiHeadBayesianAttention(0, 4, BamConfig("wc"))
    for build in (lambda: MultiHeadBayesianAttention(32, 4, "wc"), lambda: BayesianAttention("wc", 4, 8)):
        with pytest.raises(TypeError, match="config must be a BamConfig \\(e.g. BamConfig\\('wc'\\)\\), got 'wc'"):
            build()


def test_a_mask_that_does_not_fit_names_itself_and_the_shape_expected():
    attn = MultiHeadBayesianAttention(8, 2, BamConfig("wc"))
    x = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match=r"^valid_keys of shape \(3, 4\) does not fit key of shape \(2, 4, \d+\): expected \[2, 4\] or \[4\]"):
        attn(x, x, x, valid_keys=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^valid_queries of shape \(3, 4\) does not fit query of shape \(2, 4, \d+\): expected \[2, 4\] or \[4\]"):
        attn(x, x, x, valid_queries=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attention mask of shape \(3, 1, 1, 4\) does not broadcast to the batch \(2,\)"):
        DenseKeys(torch.ones(3, 1, 1, 4, dtype=torch.bool), batch_shape=torch.Size([2]))
    with pytest.raises(ValueError, match=r"attention mask of shape \(3, 1, 1, 4\) and query_mask of shape \(2, 1, 4, 1\)"):
        DenseKeys(torch.ones(3, 1, 1, 4, dtype=torch.bool), query_mask=torch.ones(2, 1, 4, 1, dtype=torch.bool))


@pytest.mark.parametrize("variant", ["soft", "wc", "lf"])
def test_a_query_with_every_key_masked_gets_zero_weights_and_no_kl(variant):
    """Sentence 1 has no valid key: its rows are all zero (no weight on padding) in the point
    prediction, in a draw and at the model's site, its gradients finite, and the site's KL is
    sentence 0's alone."""
    layer = MultiHeadBayesianAttention(8, 2, BamConfig(variant))
    x = torch.randn(2, 4, 8)
    valid = torch.tensor([[True, True, True, False], [False] * 4])
    for training in (False, True):
        out, weights = layer.train(training)(x, x, x, valid_keys=valid)
        assert torch.all(weights[1] == 0) and torch.allclose(weights[0].sum(-1), torch.ones(2, 4))
    out.pow(2).sum().backward()  # and the gradients stay finite
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)
    if variant == "soft":
        return

    def site(inputs, keys_valid):
        found = {}

        def model():
            with attention_sites():
                found["weights"] = layer(inputs, inputs, inputs, valid_keys=keys_valid)[1]

        guide = AttentionGuide(model)
        guide()
        model_trace, guide_trace = guide.get_traces()
        kl = torch.distributions.kl_divergence(guide_trace.nodes["attention"]["fn"], model_trace.nodes["attention"]["fn"])
        return kl.item(), found["weights"]

    kl, weights = site(x, valid)
    assert torch.all(weights[1] == 0) and torch.allclose(weights[0].sum(-1), torch.ones(2, 4))
    assert kl == pytest.approx(site(x[:1], valid[:1])[0], rel=1e-5)


def test_a_file_that_is_not_a_checkpoint_is_named_as_damaged(tmp_path):
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": {}, "metadata": {}}, path)  # a torch file, not a whole checkpoint
    contents = {b"": "an empty file", b"PK\x03\x04 cut": "not a readable checkpoint",
                path.read_bytes(): "not a checkpoint of SVITrainer: no optimizer, epoch, history"}
    for content, reason in contents.items():
        path.write_bytes(content)
        with pytest.raises(DamagedFile, match=f"{path} is damaged \\({reason}.*\\): delete it") as error:
            read_checkpoint(path)
        assert "\n" not in str(error.value)


def test_a_graph_is_checked_again_only_once_it_is_written(monkeypatch):
    """The model checks a graph's values once per tensor contents: the features that come back every
    step are not read again, and a NaN written into them in place is still caught."""
    import bam_pyro.pyg.node_classifier as node_classifier
    from models.gat import build_node_classifier

    x, edge_index, _ = random_graph()
    model = build_node_classifier(x.size(1), 3, BamConfig("wc"), ObjectiveConfig(), heads=2, hidden=4)
    checks = []
    monkeypatch.setattr(node_classifier, "validate_graph", lambda *graph: (checks.append(graph), validate_graph(*graph)))
    for _ in range(3):
        model.model(x, edge_index)
    assert len(checks) == 1
    model.model(x.clone(), edge_index)  # other tensors, equal values: checked
    assert len(checks) == 2
    x[3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"NaN or inf at 1 nodes \(first: \[3\]\)"):
        model.model(x, edge_index)
    edge_index[0, 0] = 10_000
    with pytest.raises(ValueError, match="outside"):
        model.model(x.nan_to_num(), edge_index)
