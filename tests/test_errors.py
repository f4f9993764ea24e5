"""Bad input fails early with an error that names the problem."""

import pytest
import torch

from bam_pyro import BamConfig, DenseKeys, MultiHeadBayesianAttention, ObjectiveConfig
from bam_pyro.pyg import EdgeKeys
from experiments.data_root import require_files
from experiments.bench import main as bench_main
from experiments.gat import TASK as GAT
from experiments.gat import main as gat_main
from experiments.glue import TASK as GLUE
from experiments.planetoid import load_planetoid
from bam_pyro.pyg import validate_graph
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
    with pytest.raises(ValueError, match="key_padding_mask has 3 keys, key has 4"):
        attn(torch.randn(1, 4, 8), torch.randn(1, 4, 8), torch.randn(1, 4, 8), key_padding_mask=torch.ones(1, 3, dtype=torch.bool))
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
