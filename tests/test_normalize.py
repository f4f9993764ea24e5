"""The lean normalizations give the values and gradients of the plain torch expressions, dense
(with padding) and sparse, and their backward keeps no extra attention maps."""

import math

import pytest
import torch

from bam_pyro import DenseKeys
from bam_pyro.pyg import EdgeKeys
from bam_pyro.normalize import LOG_FLOOR, log_normalized, normalize


def dense_case():
    scores = (torch.randn(2, 3, 4, 6, dtype=torch.float64) * 4).requires_grad_()
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    mask[0, ..., 4:] = False
    return scores, DenseKeys(mask)


def sparse_case():
    edge_index = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 1, 2, 0], [1, 1, 1, 2, 2, 3, 0, 0, 0, 0]])
    scores = (torch.randn(edge_index.size(1), 2, dtype=torch.float64) * 4).requires_grad_()
    return scores, EdgeKeys(edge_index, 7)


@pytest.mark.parametrize("case", [dense_case, sparse_case])
def test_log_normalized_matches_the_plain_expression(case):
    scores, axis = case()
    upstream = torch.randn_like(scores)
    lean = log_normalized(axis, scores)
    plain = torch.log(axis.softmax(scores) + LOG_FLOOR)
    assert torch.allclose(lean, plain)
    (lean_grad,) = torch.autograd.grad(lean, scores, upstream)
    (plain_grad,) = torch.autograd.grad(plain, scores, upstream)
    assert torch.allclose(lean_grad, plain_grad, atol=1e-12)
    assert torch.autograd.gradcheck(lambda s: log_normalized(axis, s), (scores,))


def test_sparse_log_normalized_gradient_where_the_softmax_falls_below_the_floor():
    """Scores spread wide enough that some softmax entries are far below 1e-20, where the floor
    flattens log(p + 1e-20) and its gradient must vanish."""
    scores, axis = sparse_case()
    scores = (scores.detach() * 10).requires_grad_()
    assert (axis.softmax(scores) < 1e-3 * LOG_FLOOR).any()
    upstream = torch.randn_like(scores)
    (lean_grad,) = torch.autograd.grad(log_normalized(axis, scores), scores, upstream)
    (plain_grad,) = torch.autograd.grad(torch.log(axis.softmax(scores) + LOG_FLOOR), scores, upstream)
    assert torch.allclose(lean_grad, plain_grad, atol=1e-12)


def test_dense_log_normalized_gradient_is_exactly_zero_at_masked_keys():
    scores, axis = dense_case()
    (grad,) = torch.autograd.grad(log_normalized(axis, scores), scores, torch.randn_like(scores))
    assert (grad[0, ..., 4:] == 0).all()


@pytest.mark.parametrize("case", [dense_case, sparse_case])
def test_normalize_matches_dividing_by_the_sum(case):
    scores, axis = case()
    s = torch.exp(scores.detach() / 2).requires_grad_()
    upstream = torch.randn_like(s)
    weights = normalize(axis, s)
    if isinstance(axis, DenseKeys):
        plain = s * axis.mask / (s * axis.mask).sum(-1, keepdim=True)
    else:  # sums over each target's incoming edges, built independently of the axis
        sums = torch.zeros(7, s.size(1), dtype=s.dtype).index_add(0, axis.target, s)
        plain = s / sums[axis.target]
    assert torch.allclose(weights, plain)
    (lean_grad,) = torch.autograd.grad(weights, s, upstream)
    (plain_grad,) = torch.autograd.grad(plain, s, upstream)
    assert torch.allclose(lean_grad, plain_grad, atol=1e-12)


def test_normalize_survives_underflowing_and_huge_weights():
    """S spanning 1e-38 .. 1e30 (tiny Weibull draws, wide Lognormals) still gives simplex rows."""
    s = torch.tensor([[1e-38, 1e-30, 0.0], [1e30, 1.0, 1e-20]], requires_grad=True)
    w = normalize(DenseKeys(), s)
    assert torch.isfinite(w).all() and torch.allclose(w.sum(-1), torch.ones(2))
    w[:, 0].sum().backward()
    assert torch.isfinite(s.grad).all()


def test_backward_saves_only_tensors_the_step_holds_anyway():
    """Saved for backward: Phi (the guide's parameter) and S (the site's value), nothing else of
    attention-map size. Counted with autograd's saved-tensor hooks."""
    scores, axis = dense_case()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        phi = log_normalized(axis, scores)
        s = torch.exp(phi + torch.randn_like(phi))
        normalize(axis, s)
    big = {t.data_ptr() for t in saved if t.numel() == scores.numel()}
    assert big == {phi.data_ptr(), s.data_ptr()}


def test_normalize_falls_back_to_log_space_when_the_sums_overflow():
    """float32 sums of S near the largest float are inf: the weights still come out right."""
    s = torch.tensor([[3e38, 3e38, 1e38], [1.0, 2.0, 1.0]], requires_grad=True)
    w = normalize(DenseKeys(), s)
    assert torch.allclose(w, torch.tensor([[3 / 7, 3 / 7, 1 / 7], [0.25, 0.5, 0.25]]))
    w[:, 0].sum().backward()
    assert torch.isfinite(s.grad).all()


def test_normalize_of_rows_with_infinite_entries_shares_the_weight_among_them():
    """Draws of a LogNormal prior with sigma_p = 1e15 are inf or 0: each inf weighs as the largest
    float, so a row stays a distribution."""
    s = torch.tensor([[math.inf, 1.0, 0.0], [math.inf, math.inf, 1.0]])
    w = normalize(DenseKeys(), s)
    assert torch.allclose(w, torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]]))


def test_normalize_of_an_all_zero_row_is_uniform():
    """Every draw of a row underflowed: the sum is 0, the log-space route gives a finite simplex."""
    s = torch.tensor([[0.0, 0.0, 0.0], [1.0, 2.0, 1.0]], requires_grad=True)
    w = normalize(DenseKeys(), s)
    assert torch.allclose(w, torch.tensor([[1 / 3, 1 / 3, 1 / 3], [0.25, 0.5, 0.25]]))


@pytest.mark.parametrize("spread", [4.0, 400.0])  # one shared shift; per-target shifts (fallback)
def test_edge_softmax_equals_pyg_segment_softmax(spread):
    from torch_geometric.utils import softmax as segment_softmax

    scores, axis = sparse_case()
    scores = (scores.detach() / 4 * spread).requires_grad_()
    upstream = torch.randn_like(scores)
    ours, reference = axis.softmax(scores), segment_softmax(scores, axis.target, num_nodes=7, dim=-2)
    assert torch.allclose(ours, reference, atol=1e-12)
    (ours_grad,) = torch.autograd.grad(ours, scores, upstream)
    (reference_grad,) = torch.autograd.grad(reference, scores, upstream)
    assert torch.allclose(ours_grad, reference_grad, atol=1e-12)


def test_edge_softmax_in_float16_shifts_each_target_by_its_own_maximum():
    """Two targets whose scores lie 40 apart: one shared shift underflows float16 (0 / 0 = NaN);
    each target's own maximum gives float32's answer."""
    axis = EdgeKeys(torch.tensor([[0, 1, 2, 3], [0, 0, 1, 1]]), num_nodes=2)
    scores = torch.tensor([[1.0], [0.0], [-40.0], [-39.0]])
    got = axis.softmax(scores.half())
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), axis.softmax(scores), atol=1e-3, rtol=0)


@pytest.fixture
def no_host_reads(monkeypatch):
    """The branch-free paths taken on accelerators, on meta and under torch.compile, run on CPU."""
    import bam_pyro.axes
    import bam_pyro.normalize
    import bam_pyro.pyg.edge_keys

    for module in (bam_pyro.axes, bam_pyro.normalize, bam_pyro.pyg.edge_keys):
        monkeypatch.setattr(module, "values_at_hand", lambda t: False)


def mixed_rows():
    """Rows the ratio takes, an all-zero row, an overflowing row, a row with inf, an empty row."""
    s = torch.tensor([[1.0, 2.0, 1.0, 0.5], [0.0, 0.0, 0.0, 0.0], [3e38, 3e38, 1e38, 1.0],
                      [math.inf, 1.0, 0.0, 2.0], [4.0, 1.0, 2.0, 3.0], [0.3, 0.1, 0.2, 0.4]])
    mask = torch.ones(1, 1, 6, 4, dtype=torch.bool)
    mask[..., 4, :] = False  # no valid key: zero weights
    mask[..., 5, 3] = False
    return s, mask


def test_branch_free_normalize_gives_each_row_the_values_and_gradients_of_its_path(no_host_reads):
    """Each row by itself through the eager CPU path: the ratio rows bit for bit, the others in log space."""
    s, mask = mixed_rows()
    s = s.requires_grad_()
    upstream = torch.randn(1, 1, 6, 4)
    weights = normalize(DenseKeys(mask), s.view(1, 1, 6, 4))
    (grad,) = torch.autograd.grad(weights, s, upstream)
    assert torch.isfinite(weights).all() and torch.isfinite(grad).all()
    assert (weights[..., 4, :] == 0).all() and (weights[..., 5, 3] == 0)
    for row in (0, 1, 2, 3, 5):
        alone = s.detach()[row].view(1, 1, 1, 4).requires_grad_()
        expected = normalize_on_cpu(DenseKeys(mask[..., row : row + 1, :]), alone)
        (expected_grad,) = torch.autograd.grad(expected, alone, upstream[..., row : row + 1, :])
        if row in (0, 5):  # the ratio: the same operations
            assert torch.equal(weights[..., row, :], expected[..., 0, :]) and torch.equal(grad[row], expected_grad.flatten())
        else:
            torch.testing.assert_close(weights[..., row, :], expected[..., 0, :])
            torch.testing.assert_close(grad[row], expected_grad.flatten())


def normalize_on_cpu(axis, s):
    """normalize as eager CPU runs it (the fixture's patch undone for the call)."""
    import bam_pyro.normalize
    from bam_pyro.host_reads import values_at_hand

    patched, bam_pyro.normalize.values_at_hand = bam_pyro.normalize.values_at_hand, values_at_hand
    try:
        return normalize(axis, s)
    finally:
        bam_pyro.normalize.values_at_hand = patched


def test_branch_free_dense_softmax_zeroes_empty_rows_and_equals_the_eager_one(no_host_reads):
    scores = torch.randn(1, 1, 6, 4)
    _, mask = mixed_rows()
    axis = DenseKeys(mask)
    assert axis.empty_rows is not None  # no look at the mask: the fill always runs
    weights = axis.softmax(scores)
    assert (weights[..., 4, :] == 0).all()
    mask[..., 4, :] = True  # no empty row: the same weights as the eager path's, which skips the fill
    assert torch.equal(DenseKeys(mask).softmax(scores), torch.softmax(scores.masked_fill(~mask, torch.finfo(scores.dtype).min), -1))


@pytest.mark.parametrize("spread", [4.0, 400.0])
def test_edge_softmax_without_host_reads_picks_what_eager_picks(no_host_reads, spread):
    """Compiled on CPU the pick is a torch.cond in the graph; it takes the same shift."""
    scores, axis = sparse_case()
    scores = scores.detach() / 4 * spread
    high = scores.amax(-2, keepdim=True)
    expected = axis.shared_shift_softmax(scores, high) if spread < 80 else axis.per_target_softmax(scores)
    assert torch.equal(axis.softmax(scores), expected)


def test_the_mean_kl_weight_from_a_counted_mask_is_the_hosts_number():
    """The weight stays a 0-dim tensor on the mask's device, and scales a float32 KL to the very
    float the host's division gives."""
    from bam_pyro.sites import mean_scale

    kl = torch.randn(()).abs() * 1e3
    for kl_scale, sites, count in [(0.731, 3, 997), (1.0, 1, 12345), (0.1, 7, 3), (0.5, 2, 0)]:
        weight = mean_scale(kl_scale, sites, torch.tensor(count), torch.float32)
        assert weight.shape == () and weight.dtype == torch.float32
        assert torch.equal(kl * weight, kl * (kl_scale / (sites * max(count, 1))))
    assert mean_scale(0.5, 2, 10, torch.float32) == 0.5 / 20  # counted from shapes: a float
