"""A small MCAN (Yu et al. 2019; BAM paper appendix B.2) with Bayesian attention in every layer.

    image  [B, 3, 64, 64] uint8 -- CNN -------> grid features [B, G, C]  (standardized per cell),
           projected to d, plus a learned embedding of each cell's position
    words  [B, L] -- embedding -- LSTM -------> question       [B, L, d]
    encoder: self-attention (SA) layers over the question (key padding mask)
    decoder: per layer, SA over the image grid, then guided attention (GA): the grid's cells are
             the queries, the encoded question's words the keys and values (its padding mask)
    AttFlat: an MLP scores every word / cell, softmax, weighted sum, per modality
    fusion:  LayerNorm(question + image) -> linear classifier over the answers

Every SA and GA layer is :class:`bam_pyro.MultiHeadBayesianAttention` (dense keys), so each is one
attention site of the Pyro model :class:`VqaModel` (a categorical likelihood over the answers).

The CNN has no dropout and no batch statistics: the grid features are a deterministic function of
the image, in training and eval mode alike. ``VqaNetwork`` therefore also takes the grid features
directly (``features=``): posterior draws compute them once per image, and the noisy-data
experiment adds its noise to them. Leading sample dims of the features (Predictive's vectorized
draws expand floating-point inputs, see :mod:`bam_pyro.predictive`) broadcast through every layer;
the question, computed from integer word indices, is broadcast to them before its first random
operation, so that every draw has its own dropout masks. MC-dropout draws therefore need a
floating-point image input: the grid features, or pixels as floats (the CNN then runs per draw);
uint8 images are integers, which Predictive does not expand, so the draws of one vectorized pass
would share their dropout masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pyro.distributions as dist
import torch
from torch import Tensor, nn

from bam_pyro import BamConfig, BamModel, MultiHeadBayesianAttention, ObjectiveConfig
from bam_pyro.host_reads import value_checks_enabled
from bam_pyro.validation import whole_number


@dataclass(frozen=True)
class McanSizes:
    """Layer sizes. ``hidden``: width of the attention layers (d_model); ``features``: channels of
    the CNN's grid; ``grid``: the grid is ``grid x grid`` cells (64 / grid pixels each)."""

    hidden: int = 128
    heads: int = 4
    encoder_layers: int = 2
    decoder_layers: int = 2
    embedding: int = 64
    features: int = 64
    grid: int = 4
    dropout: float = 0.1

    def __post_init__(self) -> None:
        for name in ("hidden", "heads", "encoder_layers", "decoder_layers", "embedding"):
            whole_number(name, getattr(self, name))
        if self.features < 16 or self.features % 16:
            raise ValueError(f"features must be a multiple of 16 (the CNN's first layer has features / 4 channels, "
                             f"in groups of 4), got {self.features}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.grid not in (4, 8, 16):
            raise ValueError(f"grid must be 4, 8 or 16 (64-pixel images halved 2 to 4 times), got {self.grid}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must lie in [0, 1), got {self.dropout}")


class ImageEncoder(nn.Module):
    """uint8 images ``[B, 3, 64, 64]`` -> grid features ``[B, grid * grid, features]``.

    Stride-2 convolutions (``features / 4``, ``/ 2``, then ``features`` channels, each followed by
    GroupNorm over groups of 4 channels and a ReLU) halve the image down to the grid, a last 3x3
    convolution widens each cell's view; each cell's features are standardized (LayerNorm without
    affine parameters), so that their scale is fixed and the variance of the noisy-data experiment
    is relative to it. GroupNorm normalizes each image by itself: unlike batch statistics, the
    features stay the same function of the image in training and eval mode.
    """

    def __init__(self, features: int, grid: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for width in (features // 4, features // 2, features, features)[: (64 // grid).bit_length() - 1]:
            layers += [nn.Conv2d(channels, width, 3, stride=2, padding=1), nn.GroupNorm(width // 4, width), nn.ReLU()]
            channels = width
        layers.append(nn.Conv2d(channels, features, 3, padding=1))
        self.convolutions = nn.Sequential(*layers)
        self.standardize = nn.LayerNorm(features, elementwise_affine=False)

    def pixel_dtype(self) -> torch.dtype:
        """The dtype uint8 pixels become: the convolutions' (float64 for a float64 model)."""
        return self.convolutions[0].weight.dtype

    def forward(self, images: Tensor) -> Tensor:
        """``images``: uint8 ``[B, 3, H, W]``, or float pixels in [0, 1] ``[..., B, 3, H, W]`` whose
        leading dims (Predictive's draws expand floating-point inputs) are kept."""
        if images.dtype == torch.uint8 and images.dim() == 4:
            pixels = images.to(self.pixel_dtype()) / 255.0
        elif images.is_floating_point() and images.dim() >= 4:
            pixels = images
        else:
            raise ValueError(f"images must be uint8 [batch, 3, height, width] or float [..., batch, 3, height, width], "
                             f"got {images.dtype} {tuple(images.shape)}")
        if pixels.shape[-3] != 3:
            raise ValueError(f"images must have 3 colour channels before height and width, got shape {tuple(images.shape)}")
        grid = self.convolutions(pixels.flatten(0, -4) - 0.5).flatten(2).transpose(1, 2)  # [N, cells, features]
        return self.standardize(grid).unflatten(0, pixels.shape[:-3])


class FeedForward(nn.Sequential):
    def __init__(self, hidden: int, dropout: float) -> None:
        super().__init__(nn.Linear(hidden, 4 * hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(4 * hidden, hidden))


class AttentionSublayer(nn.Module):
    """``LayerNorm(x + dropout(attention(x, context, context)))``: MCAN's residual unit.

    ``context_mask`` marks the valid keys; ``query_mask`` the valid rows of ``x`` (a padded
    question attending to itself), whose padded rows then carry no KL."""

    def __init__(self, sizes: McanSizes, config: BamConfig) -> None:
        super().__init__()
        self.attention = MultiHeadBayesianAttention(sizes.hidden, sizes.heads, config, dropout=sizes.dropout)
        self.dropout = nn.Dropout(sizes.dropout)
        self.norm = nn.LayerNorm(sizes.hidden)

    def forward(self, x: Tensor, context: Tensor, context_mask: Optional[Tensor],
                query_mask: Optional[Tensor] = None) -> Tensor:
        out, _ = self.attention(x, context, context, valid_keys=context_mask, valid_queries=query_mask)
        return self.norm(x + self.dropout(out))


class FeedForwardSublayer(nn.Module):
    def __init__(self, sizes: McanSizes) -> None:
        super().__init__()
        self.ffn = FeedForward(sizes.hidden, sizes.dropout)
        self.dropout = nn.Dropout(sizes.dropout)
        self.norm = nn.LayerNorm(sizes.hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x + self.dropout(self.ffn(x)))


class SelfAttentionLayer(nn.Module):
    """MCAN's SA unit: self-attention, then a feed-forward block."""

    def __init__(self, sizes: McanSizes, config: BamConfig) -> None:
        super().__init__()
        self.self_attention = AttentionSublayer(sizes, config)
        self.feed_forward = FeedForwardSublayer(sizes)

    def forward(self, x: Tensor, mask: Optional[Tensor]) -> Tensor:
        return self.feed_forward(self.self_attention(x, x, mask, query_mask=mask))


class GuidedAttentionLayer(nn.Module):
    """MCAN's SGA unit: self-attention over the image grid, guided attention from the grid (queries)
    to the question (keys and values, padding masked), then a feed-forward block."""

    def __init__(self, sizes: McanSizes, config: BamConfig) -> None:
        super().__init__()
        self.self_attention = AttentionSublayer(sizes, config)
        self.guided_attention = AttentionSublayer(sizes, config)
        self.feed_forward = FeedForwardSublayer(sizes)

    def forward(self, image: Tensor, question: Tensor, question_mask: Tensor) -> Tensor:
        image = self.self_attention(image, image, None)
        return self.feed_forward(self.guided_attention(image, question, question_mask))


class AttentionReduction(nn.Module):
    """MCAN's AttFlat: an MLP scores each position, a softmax over the valid ones weighs them.
    Returns the reduced vector ``[..., out]`` and the weights ``[..., positions]``."""

    def __init__(self, hidden: int, out: int, dropout: float) -> None:
        super().__init__()
        self.score = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 1))
        self.merge = nn.Linear(hidden, out)

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        scores = self.score(x).squeeze(-1)
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        weights = scores.softmax(-1)
        return self.merge((weights.unsqueeze(-1) * x).sum(-2)), weights


@dataclass
class VqaOutputs:
    """The answer logits ``[..., B, answers]`` and both AttFlat weightings (question ``[..., B, L]``,
    image grid ``[..., B, G]``)."""

    logits: Tensor
    question_weights: Tensor
    image_weights: Tensor


class VqaNetwork(nn.Module):
    """The MCAN: ``network(words, images)`` or ``network(words, features=grid)`` -> answer logits."""

    def __init__(self, vocabulary_size: int, num_answers: int, config: BamConfig, sizes: McanSizes = McanSizes()) -> None:
        super().__init__()
        self.sizes = sizes
        self.image_encoder = ImageEncoder(sizes.features, sizes.grid)
        self.image_projection = nn.Linear(sizes.features, sizes.hidden)
        self.cell_embedding = nn.Parameter(0.02 * torch.randn(sizes.grid**2, sizes.hidden))  # where each cell is
        self.embedding = nn.Embedding(vocabulary_size, sizes.embedding, padding_idx=0)
        self.lstm = nn.LSTM(sizes.embedding, sizes.hidden, batch_first=True)
        self.encoder = nn.ModuleList(SelfAttentionLayer(sizes, config) for _ in range(sizes.encoder_layers))
        self.decoder = nn.ModuleList(GuidedAttentionLayer(sizes, config) for _ in range(sizes.decoder_layers))
        self.question_reduction = AttentionReduction(sizes.hidden, 2 * sizes.hidden, sizes.dropout)
        self.image_reduction = AttentionReduction(sizes.hidden, 2 * sizes.hidden, sizes.dropout)
        self.fusion_norm = nn.LayerNorm(2 * sizes.hidden)
        self.classifier = nn.Linear(2 * sizes.hidden, num_answers)

    def image_features(self, images: Tensor) -> Tensor:
        """Grid features ``[B, G, features]`` of uint8 images: what the noisy-data experiment perturbs."""
        return self.image_encoder(images)

    def forward(self, words: Tensor, images: Optional[Tensor] = None, features: Optional[Tensor] = None) -> Tensor:
        return self.outputs(words, images, features).logits

    def outputs(self, words: Tensor, images: Optional[Tensor] = None, features: Optional[Tensor] = None) -> VqaOutputs:
        """Logits and AttFlat weights, from ``images`` or from grid ``features`` (exactly one)."""
        if (images is None) == (features is None):
            raise ValueError("give the images or their grid features, exactly one of them")
        if features is None:
            features = self.image_features(images)
        if words.dim() != 2 or words.shape[0] != features.shape[-3]:
            raise ValueError(f"words [batch, length] {tuple(words.shape)} do not match features {tuple(features.shape)}")
        mask = words != 0
        if value_checks_enabled(mask) and not bool(mask[:, 0].all()):
            raise ValueError("every question needs at least one word, right-padded with 0")
        question, _ = self.lstm(self.embedding(words))  # [B, L, d], deterministic
        question = question.expand(*features.shape[:-3], *question.shape)  # the draws' own dropout
        for layer in self.encoder:
            question = layer(question, mask)
        image = self.image_projection(features) + self.cell_embedding
        for layer in self.decoder:
            image = layer(image, question, mask)
        question_vector, question_weights = self.question_reduction(question, mask)
        image_vector, image_weights = self.image_reduction(image)
        logits = self.classifier(self.fusion_norm(question_vector + image_vector))
        return VqaOutputs(logits, question_weights, image_weights)


class VqaModel(BamModel):
    """``answer ~ Categorical(logits = network(words, images | features))``, after the attention
    sites of the network's layers."""

    network: VqaNetwork

    def likelihood(self, logits: Tensor, answers: Optional[Tensor] = None) -> None:
        self.observe("answer", dist.Categorical(logits=self.align_to_plate(logits, 2)), answers)


def build_vqa_model(
    vocabulary_size: int, num_answers: int, config: BamConfig, objective: ObjectiveConfig = ObjectiveConfig(),
    sizes: McanSizes = McanSizes(),
) -> VqaModel:
    return VqaModel(VqaNetwork(vocabulary_size, num_answers, config, sizes), objective)


def guided_attention_sites(model: VqaModel) -> list[str]:
    """Attention site names of the decoder's guided-attention layers (grid -> question)."""
    return [layer.guided_attention.attention.attention.site_name for layer in model.network.decoder]
