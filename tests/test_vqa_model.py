"""The small MCAN with Bayesian attention: guided attention's padding mask, the posterior mean, the
sample dimensions of posterior draws, and errors on bad input."""

import pytest
import torch
from torch import nn
from torch.distributions import kl_divergence

from bam_pyro import AttentionGuide, BamConfig, BamModel, ObjectiveConfig
from bam_pyro.predictive import predictive_draws
from models.vqa import AttentionSublayer, McanSizes, SelfAttentionLayer, build_vqa_model, guided_attention_sites

SIZES = McanSizes(hidden=16, heads=2, encoder_layers=1, decoder_layers=2, embedding=8, features=16, grid=4, dropout=0.1)
WC = BamConfig("wc", k=1.0, beta=1e-2, d_mid=4)  # k = 1: noise large enough to see


def batch(words):
    images = torch.randint(0, 256, (len(words), 3, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    return torch.tensor(words), images


class GuidedAttention(nn.Module):
    """One guided-attention unit: image cells attend over question words."""

    def __init__(self, config):
        super().__init__()
        self.unit = AttentionSublayer(SIZES, config)

    def forward(self, image, question, mask):
        return self.unit(image, question, mask)

    def site(self):
        return self.unit.attention.attention.site_name


class QuestionSelfAttention(nn.Module):
    """The question encoder's unit: the padded question attends to itself."""

    def __init__(self, config):
        super().__init__()
        self.unit = SelfAttentionLayer(SIZES, config)

    def forward(self, question, mask):
        return self.unit(question, mask)

    def site(self):
        return self.unit.self_attention.attention.attention.site_name


class Silent(BamModel):
    def likelihood(self, outputs):
        pass


def site_kl_and_weights(model, *inputs):
    guide = AttentionGuide(model.model)
    model.record_attention = True
    guide(*inputs)
    model_trace, guide_trace = guide.get_traces()
    name = model.network.site()
    # the KL as it enters the ELBO: times the site's scale (1 / valid entries under the mean reduction)
    kl = model_trace.nodes[name]["scale"] * kl_divergence(guide_trace.nodes[name]["fn"], model_trace.nodes[name]["fn"])
    return kl, model_trace.nodes[f"{name}.weights"]["value"]


@pytest.mark.parametrize("variant", ["wc", "lc", "wf"])
def test_guided_attention_gives_padded_words_zero_weight_and_zero_kl(variant):
    config = BamConfig(variant, k=1.0, sigma_q=0.5, beta=1e-2, alpha=0.5, d_mid=4)
    model = Silent(GuidedAttention(config), objective=ObjectiveConfig(reduction="sum"))
    image = torch.randn(2, 16, SIZES.hidden)
    question = torch.randn(2, 3, SIZES.hidden)
    garbage = 100 * torch.randn(2, 4, SIZES.hidden)  # padded positions hold anything
    padded = torch.cat([question, garbage], dim=1)
    mask = torch.tensor([[True] * 3 + [False] * 4] * 2)
    kl_padded, weights = site_kl_and_weights(model, image, padded, mask)
    kl_short, _ = site_kl_and_weights(model, image, question, torch.ones(2, 3, dtype=torch.bool))
    assert weights.shape == (2, SIZES.heads, 16, 7)
    assert torch.all(weights[..., 3:] == 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, SIZES.heads, 16))
    assert kl_padded.item() > 0
    torch.testing.assert_close(kl_padded, kl_short)


@pytest.mark.parametrize("variant", ["wc", "lf"])
def test_question_self_attention_leaves_padded_words_out_as_keys_and_as_queries(variant):
    config = BamConfig(variant, k=1.0, sigma_q=0.5, beta=1e-2, d_mid=4)
    question = torch.randn(2, 3, SIZES.hidden)
    padded = torch.cat([question, 100 * torch.randn(2, 4, SIZES.hidden)], dim=1)
    mask = torch.tensor([[True] * 3 + [False] * 4] * 2)
    for reduction in ("sum", "mean"):  # a padded row neither adds KL nor counts in the mean
        model = Silent(QuestionSelfAttention(config), objective=ObjectiveConfig(reduction=reduction))
        kl_padded, weights = site_kl_and_weights(model, padded, mask)
        kl_short, _ = site_kl_and_weights(model, question, torch.ones(2, 3, dtype=torch.bool))
        assert torch.all(weights[..., 3:] == 0)
        assert kl_padded.item() > 0
        torch.testing.assert_close(kl_padded, kl_short)


def test_padding_a_question_changes_no_prediction():
    model = build_vqa_model(10, 5, WC, sizes=SIZES).eval()
    words, images = batch([[3, 4, 5, 0, 0], [3, 4, 5, 6, 7]])
    with torch.no_grad():
        together = model.network(words, images)
        alone = model.network(words[:1, :3], images[:1])
    torch.testing.assert_close(together[:1], alone)


def test_posterior_mean_is_soft_attention_with_the_same_weights():
    torch.manual_seed(0)
    bam = build_vqa_model(10, 5, WC, sizes=SIZES)
    soft = build_vqa_model(10, 5, BamConfig("soft"), sizes=SIZES)
    missing, unexpected = soft.load_state_dict(bam.state_dict(), strict=False)
    assert not missing and all("prior_net" in name for name in unexpected)
    words, images = batch([[3, 4, 5, 0], [6, 7, 8, 9]])
    bam.eval(), soft.eval()
    with torch.no_grad():
        torch.testing.assert_close(bam.network(words, images), soft.network(words, images))
        draws = predictive_draws(bam, (words, images), 4).probs  # attention drawn from q: not the mean
    assert not torch.allclose(draws[0], soft.network(words, images).softmax(-1), atol=1e-3)


@pytest.mark.parametrize("variant, dropout, image_input", [
    ("soft", True, "features"), ("soft", True, "pixels"), ("wc", False, "features"), ("wc", True, "features"),
])
def test_vectorized_draws_carry_their_own_noise(variant, dropout, image_input):
    """Predictive's draws of one vectorized pass differ (MC dropout needs a floating-point image
    input to get the draws' dimension: grid features, or float pixels through the CNN); the guided
    attention's draws are recorded and give padded words zero weight."""
    model = build_vqa_model(10, 5, WC if variant == "wc" else BamConfig("soft"), sizes=SIZES)
    words, images = batch([[3, 4, 0], [6, 7, 8], [5, 0, 0]])
    if image_input == "features":
        inputs = (words, None, model.network.image_features(images).detach())
    else:
        inputs = (words, images.float() / 255)
    layers = guided_attention_sites(model) if variant == "wc" else []
    with torch.no_grad():
        draws = predictive_draws(model, inputs, 6, dropout=dropout, layers=layers, chunk_size=6)
    assert draws.probs.shape == (6, 3, 5)
    assert (draws.probs.std(0) > 1e-4).any(-1).all()  # every question's answer varies over the draws
    for name in layers:
        weights = draws.attention[name]
        assert weights.shape == (6, 3, SIZES.heads, 16, 3)
        assert torch.all(weights[:, 0, ..., 2] == 0) and torch.all(weights[:, 2, ..., 1:] == 0)


def test_the_question_gets_the_draws_dimension_before_its_dropout():
    """Only the image features carry the draws' dimension into the network; the question branch
    (from integer words) must take it on before the encoder's dropout, or the draws would share it."""
    network = build_vqa_model(10, 5, BamConfig("soft"), sizes=SIZES).network.train()
    words, images = batch([[3, 4, 0], [6, 7, 8]])
    features = network.image_features(images).detach().expand(5, 2, 16, 16)
    weights = network.outputs(words, features=features).question_weights  # from the encoder alone
    assert weights.shape == (5, 2, 3)
    assert not torch.allclose(weights[0], weights[1])


def test_float_pixels_give_the_features_of_uint8_images():
    network = build_vqa_model(10, 5, WC, sizes=SIZES).network
    images = batch([[1], [2]])[1]
    expanded = (images.float() / 255).expand(4, 2, 3, 64, 64)
    torch.testing.assert_close(network.image_features(expanded), network.image_features(images).expand(4, 2, 16, 16))


def test_grid_features_are_standardized_per_cell():
    model = build_vqa_model(10, 5, WC, sizes=SIZES)
    features = model.network.image_features(batch([[1]] * 3)[1])
    assert features.shape == (3, 16, SIZES.features)
    torch.testing.assert_close(features.mean(-1), torch.zeros(3, 16), atol=1e-5, rtol=0)
    # LayerNorm divides by sqrt(var + 1e-5): a cell of small spread ends a little below 1
    torch.testing.assert_close(features.var(-1, unbiased=False), torch.ones(3, 16), atol=0.05, rtol=0)


def test_bad_network_inputs_are_named():
    network = build_vqa_model(10, 5, WC, sizes=SIZES).network
    words, images = batch([[3, 4], [5, 0]])
    with pytest.raises(ValueError, match="exactly one"):
        network(words, images, features=network.image_features(images))
    with pytest.raises(ValueError, match="images must be uint8 .* or float"):
        network(words, images.long())
    with pytest.raises(ValueError, match="at least one word"):
        network(torch.tensor([[3, 4], [0, 0]]), images)
    with pytest.raises(ValueError, match="divisible"):
        McanSizes(hidden=10, heads=4)
