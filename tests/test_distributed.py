"""SVITrainer on Lightning Fabric: two gloo processes (DDP) against each other and against one
process, exact resume on one and two processes, checkpoints read onto another device map, mixed
precision, the device settings, and the attention sites' context under threads."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Callable

import pytest
import torch

from bam_pyro import BamConfig, MultiHeadBayesianAttention, attention_sampling, attention_sites
from bam_pyro.distributed import DeviceSettings, FabricEngine, LocalEngine, engine_for
from bam_pyro.sites import active_sites, sampling_requested
from bam_pyro.training import read_checkpoint, shard
from experiments.runner import build_parser

from . import distributed_worker as worker


def run_two_processes(target: Callable[[], object]) -> None:
    """``target()`` in two processes forked from this one (so that nothing is imported again), with
    the variables ``torchrun`` sets: Fabric finds a torchrun launch."""
    import lightning.fabric  # noqa: F401  (imported before the fork, not by each process)

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def process(rank: int) -> None:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="test")
        torch.set_num_threads(1)
        target()

    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=process, args=(rank,)) for rank in range(2)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=300)
    assert [p.exitcode for p in processes] == [0, 0], "a training process failed (its traceback is above)"


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict[str, list[dict]]:
    """What each of two DDP processes ended with, per case of :mod:`tests.distributed_worker`."""
    out = tmp_path_factory.mktemp("ddp")
    run_two_processes(lambda: worker.main(out))
    return {case: [torch.load(out / f"{case}-rank{rank}.pt", weights_only=True) for rank in range(2)]
            for case in ("noisy", "resumed", "soft")}


def same_parameters(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_processes_hold_the_same_parameters_and_draw_different_noise(two_processes):
    first, second = two_processes["noisy"]
    assert same_parameters(first["params"], second["params"])
    assert first["history"] == second["history"]  # losses and metrics averaged over the processes
    assert first["probe_loss"] != second["probe_loss"]  # one more loss, same parameters: other noise


def test_two_processes_without_noise_match_one_process_on_the_global_batch(two_processes):
    """Soft attention without dropout: each process's step on its minibatch, gradients averaged,
    is one process's step on the two minibatches together (the mean reduction)."""
    trainer, batches, evaluate = worker.make_trainer("soft", merge=2)
    trainer.fit(batches, evaluate, max_epochs=1, progress=False)
    for rank in range(2):
        got = two_processes["soft"][rank]
        for name, value in trainer.model.state_dict().items():
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=1e-6, msg=name)
        assert got["history"][0]["loss"] == pytest.approx(trainer.history[0]["loss"], rel=1e-6)
    untrained, _, _ = worker.make_trainer("soft")
    assert not torch.allclose(untrained.model.state_dict()["network.conv1.lin.weight"],
                              trainer.model.state_dict()["network.conv1.lin.weight"])  # it did train


def test_two_processes_resume_inside_an_epoch_bit_for_bit(two_processes):
    """Killed two steps into the second epoch and resumed by fresh trainers: each process's own
    noise stream and epoch losses come back from the one checkpoint process 0 wrote."""
    for rank in range(2):
        assert same_parameters(two_processes["resumed"][rank]["params"], two_processes["noisy"][rank]["params"])
        assert two_processes["resumed"][rank]["history"] == two_processes["noisy"][rank]["history"]


@pytest.mark.slow  # Cora and a GAT in two processes: about 20 s on a busy machine
def test_the_runner_trains_a_run_on_two_processes_and_writes_one_record(tmp_path, data_root):
    from experiments.gat import task as gat

    out = tmp_path / "gat"
    run_two_processes(lambda: gat.main(["--variant", "wc", "--max-epochs", "3", "--devices", "2", "--accelerator", "cpu",
                                        "--threads", "1", "--no-progress", "--data-root", str(data_root), "--out", str(out)]))
    runs = list((out / "runs").iterdir())
    assert [run.name for run in runs] == ["cora-wc-seed0"]
    assert {path.name for path in runs[0].iterdir()} == {"record.json", "checkpoint.pt", ".lock"}
    record = json.loads((runs[0] / "record.json").read_text())
    assert record["environment"] == {"accelerator": "cpu", "devices": ["cpu", "cpu"], "processes": 2, "num_nodes": 1,
                                     "strategy": "DDPStrategy", "precision": "32-true", "deterministic_algorithms": False}
    assert record["training"]["epochs"] == 3 and len(record["training"]["history"]) == 3
    assert len((out / "results.csv").read_text().splitlines()) == 2  # header and the one run


def cpu_fabric(precision: str = "32-true") -> FabricEngine:
    return FabricEngine(DeviceSettings(accelerator="cpu", devices=1, precision=precision)).launch()


def test_resume_inside_an_epoch_on_fabric_matches_the_uninterrupted_run(tmp_path):
    engine = cpu_fabric()
    reference, batches, evaluate = worker.make_trainer("wc", engine)
    reference.fit(batches, evaluate, max_epochs=2, progress=False)
    local, batches, evaluate = worker.make_trainer("wc")
    local.fit(batches, evaluate, max_epochs=2, progress=False)
    assert same_parameters(local.model.state_dict(), reference.model.state_dict())  # Fabric on one CPU = no Fabric

    checkpoint = tmp_path / "run.pt"
    crashed, batches, evaluate = worker.make_trainer("wc", engine, checkpoint, crash_after=worker.MINIBATCHES + 3)
    with pytest.raises(worker.Crash):
        crashed.fit(batches, evaluate, max_epochs=2, progress=False)
    assert read_checkpoint(checkpoint)["step_in_epoch"] == 3
    torch.manual_seed(1234)
    resumed, batches, evaluate = worker.make_trainer("wc", engine, checkpoint)
    resumed.fit(batches, evaluate, max_epochs=2, progress=False)
    assert same_parameters(resumed.model.state_dict(), reference.model.state_dict())
    assert resumed.history == reference.history


@pytest.fixture
def restore_determinism():
    yield
    torch.use_deterministic_algorithms(False)


def test_deterministic_option_turns_on_torchs_deterministic_algorithms_and_the_record_says_so(tmp_path, data_root,
                                                                                              restore_determinism):
    from experiments.gat import task as gat

    assert not torch.are_deterministic_algorithms_enabled()
    gat.main(["--variant", "wc", "--max-epochs", "2", "--deterministic", "--threads", "1", "--no-progress",
              "--data-root", str(data_root), "--out", str(tmp_path)])
    assert torch.are_deterministic_algorithms_enabled() and os.environ["CUBLAS_WORKSPACE_CONFIG"]
    record = json.loads(next((tmp_path / "runs").glob("*/record.json")).read_text())
    assert record["environment"]["deterministic_algorithms"] is True


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_deterministic_resume_inside_an_epoch_on_a_gpu_is_exact(tmp_path, restore_determinism):
    """With deterministic algorithms a GPU run killed inside an epoch and resumed takes the steps of
    the uninterrupted run, bit for bit (or an operation of the GAT without a deterministic CUDA kernel
    raises here, naming itself)."""
    engine = engine_for(DeviceSettings(accelerator="cuda", devices=1, deterministic=True))
    assert torch.are_deterministic_algorithms_enabled()
    reference, batches, evaluate = worker.make_trainer("wc", engine)
    reference.fit(batches, evaluate, max_epochs=2, progress=False)
    checkpoint = tmp_path / "run.pt"
    crashed, batches, evaluate = worker.make_trainer("wc", engine, checkpoint, crash_after=worker.MINIBATCHES + 3)
    with pytest.raises(worker.Crash):
        crashed.fit(batches, evaluate, max_epochs=2, progress=False)
    resumed, batches, evaluate = worker.make_trainer("wc", engine, checkpoint)
    resumed.fit(batches, evaluate, max_epochs=2, progress=False)
    assert same_parameters(resumed.model.state_dict(), reference.model.state_dict())


def test_lazy_parameters_are_made_before_fabric_wraps_the_model():
    import pyro.distributions as dist

    from bam_pyro import AttentionGuide, BamModel, ObjectiveConfig
    from bam_pyro.training import SVITrainer

    class Classifier(BamModel):
        def likelihood(self, logits, y=None):
            self.observe("y", dist.Categorical(logits=logits), y)

    model = Classifier(torch.nn.LazyLinear(3), ObjectiveConfig())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    x, y = torch.randn(12, 5), torch.arange(12) % 3
    trainer = SVITrainer(model, AttentionGuide(model.model), optimizer, engine=cpu_fabric())
    calls = []
    model.network.register_forward_pre_hook(lambda module, args: calls.append(torch.is_grad_enabled()))
    trainer.fit(lambda: [((x,), {"y": y})] * 4, lambda: {}, max_epochs=3, progress=False)
    assert calls == [False] + [True] * 12  # a pass without gradients made them, then the steps
    assert model.network.weight.shape == (3, 5)
    assert trainer.history[-1]["loss"] < trainer.history[0]["loss"]  # the optimizer trains the materialized tensors


def test_a_checkpoint_reads_onto_another_device_map_and_needs_as_many_processes(tmp_path):
    checkpoint = tmp_path / "run.pt"
    trainer, batches, evaluate = worker.make_trainer("wc", checkpoint=checkpoint)
    trainer.fit(batches, evaluate, max_epochs=1, progress=False)

    def tensors(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, dict):
            for item in value.values():
                yield from tensors(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from tensors(item)

    on_meta = list(tensors(read_checkpoint(checkpoint, map_location="meta")))
    assert len(on_meta) > 20 and all(t.device.type == "meta" for t in on_meta)  # parameters, Adam's moments, RNG states

    state = torch.load(checkpoint, weights_only=True)
    state["processes"] = [{"rng": state["rng"], "epoch_losses": []}] * 2  # as if two processes wrote it
    torch.save(state, checkpoint)
    other, batches, evaluate = worker.make_trainer("wc", checkpoint=checkpoint)
    with pytest.raises(ValueError, match=r"written by 2 training process\(es\), this run has 1"):
        other.fit(batches, evaluate, max_epochs=2, progress=False)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_checkpoint_written_on_a_gpu_resumes_on_the_cpu(tmp_path):
    checkpoint = tmp_path / "run.pt"
    gpu = FabricEngine(DeviceSettings(accelerator="cuda", devices=1)).launch()
    trainer, batches, evaluate = worker.make_trainer("wc", gpu, checkpoint)
    trainer.fit(batches, evaluate, max_epochs=1, progress=False)
    assert next(trainer.model.parameters()).device.type == "cuda"
    saved = {name: value.cpu() for name, value in trainer.model.state_dict().items()}
    resumed, batches, evaluate = worker.make_trainer("wc", checkpoint=checkpoint)  # this process, on the CPU
    resumed.fit(batches, evaluate, max_epochs=1, progress=False)  # finished: loads and trains no more
    assert same_parameters(resumed.model.state_dict(), saved)
    resumed.fit(batches, evaluate, max_epochs=2, progress=False)
    assert resumed.epoch == 2 and torch.isfinite(torch.tensor(resumed.history[-1]["loss"]))


def test_bf16_mixed_runs_the_step_under_autocast_with_float32_parameters():
    trainer, batches, evaluate = worker.make_trainer("wc", cpu_fabric("bf16-mixed"))
    autocast = []
    trainer.model.network.register_forward_pre_hook(lambda module, args: autocast.append(torch.is_autocast_enabled("cpu")))
    trainer.fit(batches, evaluate, max_epochs=1, progress=False)
    assert autocast == [True] * worker.MINIBATCHES + [False]  # the training steps, then the evaluation
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in trainer.model.parameters())
    assert torch.isfinite(torch.tensor(trainer.history[0]["loss"]))


def test_shard_gives_every_process_as_many_batches_covering_the_epoch():
    for world_size in (1, 2, 3):
        for count in range(8):
            shares = [list(shard(range(count), rank, world_size)) for rank in range(world_size)]
            assert {len(s) for s in shares} == {-(-count // world_size)}
            assert sorted(set(sum(shares, []))) == list(range(count))
            for rank, items in enumerate(shares):  # round by round, the padding from the start
                rounds = range(rank, len(items) * world_size, world_size)
                assert items == [i if i < count else (i - count) % min(count, world_size - 1) for i in rounds]


def test_device_settings_are_validated_by_name_and_default_to_this_process():
    with pytest.raises(ValueError, match="^accelerator must be one of auto, cpu, cuda, mps, got 'tpu'$"):
        DeviceSettings(accelerator="tpu")
    with pytest.raises(ValueError, match="^devices must be a whole number >= 1, got 0$"):
        DeviceSettings(devices=0)
    with pytest.raises(ValueError, match="^precision must be one of"):
        DeviceSettings(precision="64-true")
    with pytest.raises(ValueError, match="strategy 'fsdp' is not supported"):
        FabricEngine(DeviceSettings(strategy="fsdp"))
    assert DeviceSettings(accelerator="cpu").local and not DeviceSettings(accelerator="cpu", devices=2).local
    assert isinstance(engine_for(DeviceSettings(accelerator="cpu")), LocalEngine)
    assert not DeviceSettings(accelerator="cpu", precision="bf16-mixed").local


def test_without_lightning_one_process_trains_and_fabric_options_fail_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning.fabric", None)  # as if not installed
    assert isinstance(engine_for(DeviceSettings(accelerator="cpu")), LocalEngine)
    with pytest.raises(ImportError, match=r"^training on devices .* pip install 'bam-pyro\[lightning\]'$"):
        engine_for(DeviceSettings(accelerator="cpu", devices=2))


def test_the_runner_takes_fabric_options_and_refuses_bad_ones(capsys):
    from experiments.gat.task import TASK

    parser, _ = build_parser(TASK)
    args = parser.parse_args(["--accelerator", "cuda", "--devices", "4", "--num-nodes", "2", "--strategy", "ddp",
                              "--precision", "bf16-mixed"])
    assert (args.accelerator, args.devices, args.num_nodes, args.strategy, args.precision) == ("cuda", 4, 2, "ddp", "bf16-mixed")
    assert parser.parse_args([]).devices == "auto"
    for bad in (["--devices", "0"], ["--precision", "fp8"], ["--strategy", "deepspeed"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
        assert bad[0] in capsys.readouterr().err


# --- the attention sites' context under threads -------------------------------------------------


def in_thread(function):
    result = []
    thread = threading.Thread(target=lambda: result.append(function()))
    thread.start()
    thread.join()
    return result[0]


def test_the_sites_context_is_each_threads_own():
    with attention_sites(kl_scale=0.5) as sites, attention_sampling(True):
        assert active_sites() is sites and sampling_requested() is True
        assert in_thread(active_sites) is None and in_thread(sampling_requested) is None


def test_a_network_evaluated_in_another_thread_does_not_join_a_running_model():
    """While one thread runs a model (its sites active), the same network evaluated in another
    thread predicts the posterior mean (soft attention) and declares no site."""
    torch.manual_seed(0)
    layer = MultiHeadBayesianAttention(8, 2, BamConfig("wc", k=10.0, beta=1e-2, d_mid=3)).eval()
    x = torch.randn(2, 5, 8)
    expected, _ = layer(x, x, x)
    with attention_sites() as sites:
        got, _ = in_thread(lambda: layer(x, x, x))
    assert torch.equal(got, expected) and not sites.calls


def replicate_on_cpu(module: torch.nn.Module) -> torch.nn.Module:
    """The replica ``torch.nn.parallel.replicate`` makes for a second GPU (it needs CUDA to copy the
    parameters there): every module copied by ``_replicate_for_data_parallel``, which marks it
    ``_is_replica``, its parameters set as plain attributes."""
    replica = module._replicate_for_data_parallel()
    for name, param in module._parameters.items():
        object.__setattr__(replica, name, param)
    for name, child in module._modules.items():
        replica._modules[name] = replicate_on_cpu(child)
    return replica


def test_data_parallel_replicas_are_refused_by_name():
    """``nn.DataParallel`` runs replicas in threads, which would share Pyro's trace: refused."""
    layer = MultiHeadBayesianAttention(8, 2, BamConfig("wc", k=10.0, beta=1e-2, d_mid=3))
    x = torch.randn(2, 5, 8)
    with pytest.raises(RuntimeError, match=r"^Bayesian attention does not run under nn.DataParallel"):
        replicate_on_cpu(layer)(x, x, x)
    layer(x, x, x)  # the original still runs
    assert torch.nn.DataParallel(layer)(x, x, x)[0].shape == (2, 5, 8)  # without GPUs it calls the module itself


# --- posterior draws shared out over the processes ------------------------------------------------


def gloo_collectives(profile: torch.profiler.profile) -> int:
    """The collectives a profiled block ran over gloo (the process group records each as ``gloo:<op>``)."""
    return sum(event.count for event in profile.key_averages() if event.key.startswith("gloo:"))


def drawing_case():
    """A tiny BERT with BAM-WC attention (the same on every process), set up for data-parallel
    training as the trainer sets it up, and ten examples of distinct lengths: evaluation batches of
    four, their padded lengths 4, 8 and 10. Returns a function that draws them under ``engine``,
    with the padded length of every network pass and the collectives it ran."""
    from transformers import BertConfig, BertForSequenceClassification

    from bam_pyro import AttentionGuide, ObjectiveConfig
    from bam_pyro.distributed import ElboLoss
    from bam_pyro.elbo import AttentionMeanFieldELBO
    from bam_pyro.transformers import build_sequence_model
    from experiments.glue.data import Encoded
    from experiments.glue.task import posterior_probs

    from .test_glue import collator

    torch.manual_seed(0)
    config = BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
    model = build_sequence_model(BertForSequenceClassification(config), 2, BamConfig("wc", k=5.0), ObjectiveConfig())
    lengths = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    data = Encoded([list(range(5, 5 + n)) for n in lengths], [[0] * n for n in lengths], torch.arange(10) % 2)
    pad = collator()

    def draw(engine):
        engine.setup(ElboLoss(model, AttentionGuide(model.model), AttentionMeanFieldELBO()),
                     torch.optim.SGD(model.parameters(), lr=0.1))
        passes = []
        model.network.register_forward_pre_hook(lambda module, args: passes.append(args[0].size(1)))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            probs, labels = posterior_probs(model, data, 1, pad, draws=3, seed=5, engine=engine)
        return {"probs": torch.from_numpy(probs), "labels": torch.from_numpy(labels), "passes": passes,
                "collectives": gloo_collectives(profile)}

    return draw


def test_two_processes_draw_their_share_of_the_evaluation_set_and_gather_one_processes_draws(tmp_path):
    """Each process draws only its batches (batch b on process b % 2: every pass of batch 1 on
    process 1, of batches 0 and 2 on process 0), no collective runs during the draws but the one
    gather of the results (a pass through DDP's wrapper can synchronize), and the gathered draws are
    one process's for the seed, bit for bit."""

    def process() -> None:
        engine = engine_for(DeviceSettings(accelerator="cpu"))
        drawn = drawing_case()(engine)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            engine.gather([])
        drawn["gather_collectives"] = gloo_collectives(profile)
        torch.save(drawn, tmp_path / f"rank{engine.rank}.pt")

    run_two_processes(process)
    torch.set_num_threads(1)  # as the two processes: the same kernels, the same bits
    one = drawing_case()(LocalEngine())
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    per_batch = len(one["passes"]) // 3  # Predictive's passes of one batch
    assert one["passes"] == [4] * per_batch + [8] * per_batch + [10] * per_batch
    assert ranks[0]["passes"] == [4] * per_batch + [10] * per_batch and ranks[1]["passes"] == [8] * per_batch
    for drawn in ranks:
        assert 0 < drawn["collectives"] == drawn["gather_collectives"]
        assert torch.equal(drawn["probs"], one["probs"]) and torch.equal(drawn["labels"], one["labels"])
    assert one["probs"].shape == (3, 10, 2) and one["probs"].std(0).max() > 0  # draws that differ
