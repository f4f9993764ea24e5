"""BamTrainer: transformers' Trainer on the BAM ELBO, on one process and on two gloo processes.

Run as a script under torchrun (``torchrun --standalone --nproc_per_node=2 -m
tests.test_transformers_trainer OUT.json``) it trains the tiny BERT of these tests and writes what
rank 0 saw; :func:`test_two_gloo_processes` does that.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

from bam_pyro import BamConfig, ObjectiveConfig
from bam_pyro.elbo import AttentionMeanFieldELBO
from bam_pyro.transformers import BamTrainer, build_sequence_model

WC = BamConfig("wc", k=10.0, beta=1e-2, d_mid=5)
ROOT = Path(__file__).resolve().parents[1]
STEPS = 16


class MarkerTokens(Dataset):
    """Random token sequences whose label is told by their first token (7 or 9), an easy task."""

    def __init__(self, size: int = 256, length: int = 8, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 2, (size,), generator=g)
        self.ids = torch.randint(10, 60, (size, length), generator=g)
        self.ids[:, 0] = 7 + 2 * self.labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


def tiny_bam_bert(anneal_rate: float = 0.1, kl_weight: float = 0.01):
    torch.manual_seed(0)
    config = BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=37, num_labels=2)
    return build_sequence_model(BertForSequenceClassification(config), 2, WC,
                                ObjectiveConfig(kl_weight=kl_weight, anneal_rate=anneal_rate))


def training_arguments(folder, **changes) -> TrainingArguments:
    settings = dict(output_dir=str(folder), per_device_train_batch_size=16, max_steps=STEPS, learning_rate=1e-2,
                    logging_steps=4, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
                    seed=0, dataloader_num_workers=0)
    return TrainingArguments(**{**settings, **changes})


def logged_losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_loss_is_the_elbo_with_annealed_kl(tmp_path):
    """compute_loss is the project's ELBO; moving the step changes only lambda_t's share of it."""
    bam_model = tiny_bam_bert(anneal_rate=0.05, kl_weight=1.0)
    trainer = BamTrainer(bam_model, training_arguments(tmp_path))
    batch = {k: torch.stack([MarkerTokens()[i][k] for i in range(8)]) for k in ("input_ids", "attention_mask", "labels")}
    model = trainer.model.train()

    def loss_at(step: int, via_trainer: bool = True) -> float:
        trainer.state.global_step = step
        torch.manual_seed(1)  # the same attention draws and dropout masks at every step
        if via_trainer:
            return trainer.compute_loss(model, dict(batch)).item()
        return AttentionMeanFieldELBO().differentiable_loss(
            bam_model.model, trainer.guide, batch["input_ids"], batch["attention_mask"], None, labels=batch["labels"],
            step=step).item()

    assert loss_at(0) == pytest.approx(loss_at(0, via_trainer=False), rel=1e-6)
    losses = [loss_at(t) for t in (0, 20, 60)]
    weights = [1 / (1 + math.exp(-t * 0.05)) for t in (0, 20, 60)]
    kl = (losses[1] - losses[0]) / (weights[1] - weights[0])  # loss = nll + lambda_t * kl
    assert kl > 0
    assert losses[2] - losses[0] == pytest.approx(kl * (weights[2] - weights[0]), rel=1e-4)


def test_trains_and_advances_the_annealing_step(tmp_path):
    bam_model = tiny_bam_bert()
    trainer = BamTrainer(bam_model, training_arguments(tmp_path), train_dataset=MarkerTokens())
    trainer.train()
    losses = logged_losses(trainer)
    assert trainer.state.global_step == STEPS
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < 0.8 * losses[0], losses
    # evaluation: the ELBO as eval_loss, the posterior-mean logits as predictions
    held_out = MarkerTokens(size=32, seed=1)
    predicted = trainer.predict(held_out)
    assert predicted.predictions.shape == (32, 2) and math.isfinite(predicted.metrics["test_loss"])
    assert (predicted.predictions.argmax(-1) == held_out.labels.numpy()).mean() > 0.9


def test_refuses_a_model_without_the_elbo(tmp_path):
    bam_model = tiny_bam_bert()
    with pytest.raises(TypeError, match="bam_model must be a BamModel"):
        BamTrainer(bam_model.network.model, training_arguments(tmp_path))
    with pytest.raises(TypeError, match="neither model nor compute_loss_func"):
        BamTrainer(bam_model, training_arguments(tmp_path), compute_loss_func=lambda *a, **k: 0.0)
    with pytest.raises(ValueError, match="ddp_find_unused_parameters must be False"):
        BamTrainer(bam_model, training_arguments(tmp_path, ddp_find_unused_parameters=True))
    assert BamTrainer(bam_model, args=training_arguments(tmp_path)).args.ddp_find_unused_parameters is False


@pytest.mark.slow
def test_two_gloo_processes(tmp_path):
    """Two CPU processes under torchrun (accelerate's DDP, gloo): every rank ends with the same
    parameters, the loss falls, and the annealing step follows the optimizer steps."""
    out = tmp_path / "ddp.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    "-m", "tests.test_transformers_trainer", str(out)], cwd=ROOT, env=env, check=True, timeout=300)
    result = json.loads(out.read_text())
    print(f"two gloo processes: {time.perf_counter() - started:.1f} s wall (launch included)")
    assert result["world_size"] == 2
    assert result["checksums"][0] == result["checksums"][1]
    assert result["global_step"] == STEPS
    assert result["losses"][-1] < 0.8 * result["losses"][0], result["losses"]


def _train_under_torchrun(out: str) -> None:
    """Script body: one process of the run (alone, or one rank under torchrun), a global batch of 16."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    bam_model = tiny_bam_bert()
    distributed = {"ddp_backend": "gloo"} if world > 1 else {}
    arguments = training_arguments(Path(out).parent / "trainer", per_device_train_batch_size=16 // world, **distributed)
    trainer = BamTrainer(bam_model, arguments, train_dataset=MarkerTokens())
    trainer.train()
    checksum = sum(float(p.double().sum()) for p in bam_model.parameters())
    checksums = [checksum]
    if dist.is_initialized():
        checksums = [None] * world
        dist.all_gather_object(checksums, checksum)
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(out).write_text(json.dumps({
            "world_size": world, "checksums": checksums, "losses": logged_losses(trainer),
            "global_step": trainer.state.global_step, "train_runtime_s": trainer.state.log_history[-1]["train_runtime"]}))


if __name__ == "__main__":
    _train_under_torchrun(sys.argv[1])
