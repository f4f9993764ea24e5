"""Neighbour-sampled mini-batches of the Bayesian GAT: the sampler's layout, and a mini-batch ELBO
that is unbiased for the full graph's (checked exactly over an epoch's partition of the seeds)."""

import pytest
import torch
from torch_geometric.data import Data

from bam_pyro import AttentionGuide, BamConfig, ObjectiveConfig
from bam_pyro.elbo import AttentionMeanFieldELBO
from bam_pyro.pyg import FullGraph, NeighborBatches, NodeClassifier, SubgraphNodeClassifier, neighbor_loader_available
from models.gat import GAT
from tests.conftest import random_graph

# nearly noiseless q (Weibull k = 1e5): the likelihood is the same function of Phi in every batch,
# while the KL to the contextual prior is as large as it gets
NEAR_DETERMINISTIC = BamConfig("wc", k=1e5, beta=1e-2, d_mid=3)


def graph(num_nodes=30, num_edges=90) -> Data:
    x, edge_index, y = random_graph(num_nodes, num_edges)
    labelled = torch.zeros(num_nodes, dtype=torch.bool)
    labelled[::3] = True
    return Data(x=x, edge_index=edge_index, y=y, train_mask=labelled)


def test_sampler_layout_is_neighbor_loaders():
    data = graph()
    fanout = [2, 3]
    for batch in NeighborBatches(data, fanout, batch_size=7, input_nodes=data.train_mask):
        src, dst = batch.edge_index
        assert torch.equal(batch.n_id[src], data.edge_index[0, batch.e_id])  # local ids map back to the graph's
        assert torch.equal(batch.n_id[dst], data.edge_index[1, batch.e_id])
        assert torch.equal(batch.n_id[:batch.batch_size], data.train_mask.nonzero().flatten()[batch.input_id])
        assert torch.equal(batch.x, data.x[batch.n_id]) and torch.equal(batch.y, data.y[batch.n_id])
        assert batch.n_id.unique().numel() == batch.n_id.numel() and batch.e_id.unique().numel() == batch.e_id.numel()
        assert sum(batch.num_sampled_nodes) == batch.num_nodes and sum(batch.num_sampled_edges) == batch.num_edges
        # hop h draws at most fanout[h] incoming edges of each node found at hop h - 1
        hop_nodes = torch.tensor(batch.num_sampled_nodes).cumsum(0)
        per_target = torch.bincount(dst, minlength=batch.num_nodes)
        for h, limit in enumerate(fanout):
            first = 0 if h == 0 else int(hop_nodes[h - 1])
            assert int(per_target[first:int(hop_nodes[h])].amax()) <= limit
        assert int(per_target[int(hop_nodes[len(fanout) - 1]):].sum()) == 0  # the last hop is not expanded


def test_all_neighbours_gives_every_incoming_edge_of_the_seeds_and_their_neighbours():
    data = graph()
    batch = next(iter(NeighborBatches(data, [-1, -1], batch_size=4, shuffle=False)))
    inner = batch.n_id[:batch.num_sampled_nodes[0] + batch.num_sampled_nodes[1]]
    expected = torch.isin(data.edge_index[1], inner).sum()
    assert batch.num_edges == int(expected)


def test_batches_follow_torchs_generator():
    """The seeds' order and the sampled neighbours come from torch's global generator, so a loop
    that replays its random state (SVITrainer's exact resume) gets the same batches again."""
    data = graph()
    loader = NeighborBatches(data, [2, 2], batch_size=6)

    def epoch(seed):
        torch.manual_seed(seed)
        return [(b.n_id.tolist(), b.e_id.tolist()) for b in loader]

    assert epoch(1) == epoch(1) and epoch(1) != epoch(2)


def test_refuses_what_it_cannot_do():
    data = graph()
    with pytest.raises(ValueError, match="num_neighbors must be one positive count"):
        NeighborBatches(data, [0, 5], batch_size=4)
    with pytest.raises(ValueError, match="batch_size must be a whole number"):
        NeighborBatches(data, [5], batch_size=0)
    if not neighbor_loader_available():
        with pytest.raises(ImportError, match="pyg-lib or torch-sparse"):
            NeighborBatches(data, [5], batch_size=4, use_pyg=True)


def models(data: Data, reduction: str, input_nodes: torch.Tensor):
    """The same GAT as a full-graph NodeClassifier and as a SubgraphNodeClassifier, eval mode
    (no dropout); their losses are taken at annealing step 3 (:func:`batch_loss`)."""
    objective = ObjectiveConfig(reduction=reduction, kl_weight=0.7, anneal_rate=0.2)
    network = GAT(data.num_features, 3, NEAR_DETERMINISTIC, hidden=4, heads=2).eval()
    full = NodeClassifier(network, objective)
    sub = SubgraphNodeClassifier(network, objective, FullGraph.of(data.edge_index, data.num_nodes, input_nodes, data.train_mask))
    return full, sub


def batch_loss(model, batch: Data):
    seeds_labelled = batch.train_mask[:batch.batch_size].nonzero().flatten()
    return AttentionMeanFieldELBO().differentiable_loss(
        model.model, AttentionGuide(model.model), batch.x, batch.edge_index, y=batch.y, nodes=seeds_labelled,
        num_seeds=batch.batch_size, step=3)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("seed_nodes", ["all", "labelled"])
def test_epoch_of_minibatch_elbos_is_the_full_graph_elbo(reduction, seed_nodes):
    """sum_B (b / N_in) L_B equals the full graph's loss, and so do the gradients, when every
    neighbour is sampled; counting every row of the subgraphs (no seed weighting) does not."""
    data = graph()
    all_nodes = torch.arange(data.num_nodes)
    input_nodes = all_nodes if seed_nodes == "all" else data.train_mask.nonzero().flatten()
    full, sub = models(data, reduction, input_nodes)
    rows = torch.zeros(data.num_nodes, dtype=torch.bool)
    rows[input_nodes] = True
    if seed_nodes == "labelled":  # the full-graph ELBO of the labelled nodes' rows: mask the other rows out
        expected = full_loss_of_rows(full, data, rows, sub.full_graph)
    else:
        expected = AttentionMeanFieldELBO().differentiable_loss(
            full.model, AttentionGuide(full.model), data.x, data.edge_index, y=data.y, nodes=data.train_mask.nonzero().flatten(),
            step=3)
    expected_grads = torch.autograd.grad(expected, list(full.parameters()))

    total = 0.0
    for batch in NeighborBatches(data, [-1, -1], batch_size=4, input_nodes=input_nodes):
        total = total + batch.batch_size / input_nodes.numel() * batch_loss(sub, batch)
    grads = torch.autograd.grad(total, list(sub.parameters()))
    assert float(total.detach()) == pytest.approx(float(expected.detach()), rel=1e-4)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)


def full_loss_of_rows(full: NodeClassifier, data: Data, rows: torch.Tensor, counts: FullGraph):
    """The full graph's loss with the KL of the rows of ``rows`` only: the graph relabelled so that
    those nodes come first, as seeds of a single batch holding the whole graph."""
    order = torch.cat([rows.nonzero().flatten(), (~rows).nonzero().flatten()])
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel())
    whole = Data(x=data.x[order], y=data.y[order], train_mask=data.train_mask[order],
                 edge_index=position[data.edge_index], batch_size=int(rows.sum()))
    sub = SubgraphNodeClassifier(full.network, full.objective, counts)
    return batch_loss(sub, whole)


def test_counting_every_row_of_the_subgraphs_is_biased():
    data = graph()
    all_nodes = torch.arange(data.num_nodes)
    full, _ = models(data, "sum", all_nodes)
    expected = AttentionMeanFieldELBO().differentiable_loss(
        full.model, AttentionGuide(full.model), data.x, data.edge_index, y=data.y, nodes=data.train_mask.nonzero().flatten(),
            step=3)
    total = 0.0
    for batch in NeighborBatches(data, [-1, -1], batch_size=5):
        labelled = batch.train_mask[:batch.batch_size].nonzero().flatten()
        if labelled.numel() == 0:
            continue
        naive = AttentionMeanFieldELBO().differentiable_loss(
            full.model, AttentionGuide(full.model), batch.x, batch.edge_index, y=batch.y, nodes=labelled, step=3)
        total = total + float(naive.detach())
    assert abs(total - float(expected.detach())) > 0.05 * abs(float(expected.detach()))


@pytest.mark.slow
def test_gat_task_learns_on_minibatches(data_root, tmp_path):
    """experiments.gat with --batch-size: neighbour-sampled training of BAM-WC on Cora learns."""
    from experiments.gat import task as gat
    from experiments.records import RunFolder

    gat.main(["--dataset", "cora", "--variant", "wc", "--batch-size", "35", "--num-neighbors", "5,5",
              "--max-epochs", "20", "--threads", "1", "--data-root", str(data_root), "--out", str(tmp_path)])
    record = RunFolder(tmp_path).record("cora-wc-seed0")
    assert record["settings"]["batch_size"] == 35
    assert record["metrics"]["test_acc"] > 50.0  # the majority class is 32% of the test nodes


def test_gat_task_refuses_a_bad_fanout(data_root, tmp_path, capsys):
    from experiments.gat import task as gat

    with pytest.raises(SystemExit):
        gat.main(["--batch-size", "8", "--num-neighbors", "10", "--data-root", str(data_root), "--out", str(tmp_path)])
    assert "num_neighbors must be two counts" in capsys.readouterr().err
