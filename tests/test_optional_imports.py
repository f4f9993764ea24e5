"""bam-pyro without its extras, as a user who ran ``pip install bam-pyro`` gets it.

Each check runs in a fresh interpreter where the optional packages (the keys of
``bam_pyro.optional.EXTRAS``) cannot be imported: a finder at the front of ``sys.meta_path``
refuses them as if they were not installed. ``import bam_pyro`` and a
dense training step must work there; each integration must refuse in one line that names the
missing package and the extra that installs it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bam_pyro.optional import EXTRAS

ROOT = Path(__file__).resolve().parents[1]
BLOCKER = textwrap.dedent(
    f"""
    import sys

    class _Hiding:  # a finder of sys.meta_path that no longer sees the optional packages
        def __init__(self, inner):
            self.inner = inner

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {sorted(EXTRAS)!r}:
                return None
            return self.inner.find_spec(name, path, target)

        def find_distributions(self, *args, **kwargs):  # importlib.metadata: not installed either
            find = getattr(self.inner, "find_distributions", None)
            dists = find(*args, **kwargs) if find else ()
            return (d for d in dists if (d.metadata["Name"] or "").lower().replace("-", "_") not in {sorted(EXTRAS)!r})

        def invalidate_caches(self):
            getattr(self.inner, "invalidate_caches", lambda: None)()

    sys.meta_path[:] = [_Hiding(finder) for finder in sys.meta_path if hasattr(finder, "find_spec")]
    """
)

DENSE_STEP = textwrap.dedent(
    """
    import pyro.distributions as dist
    import torch
    from pyro.infer import TraceMeanField_ELBO

    from bam_pyro import AttentionGuide, BamConfig, BamModel, MultiHeadBayesianAttention, ObjectiveConfig

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = MultiHeadBayesianAttention(8, 2, BamConfig("wc", k=10.0, beta=1e-2, d_mid=3))
            self.head = torch.nn.Linear(8, 2)

        def forward(self, x, valid):
            h, _ = self.attention(x, x, x, valid_keys=valid)
            return self.head(h.mean(-2))

    class Classifier(BamModel):
        def likelihood(self, logits, y=None):
            self.observe("y", dist.Categorical(logits=self.align_to_plate(logits, ndim=2)), y)

    torch.manual_seed(0)
    model = Classifier(Encoder(), ObjectiveConfig())
    guide = AttentionGuide(model.model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, valid, y = torch.randn(4, 5, 8), torch.ones(4, 5, dtype=torch.bool), torch.randint(0, 2, (4,))
    before = [p.detach().clone() for p in model.parameters()]
    loss = TraceMeanField_ELBO().differentiable_loss(model.model, guide, x, valid, y=y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss), loss
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters())), "no parameter moved"
    print("STEP OK")
    """
)


def run_python(code: str, blocked: bool = True) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter from the checkout, the optional packages blocked."""
    script = (BLOCKER if blocked else "") + code
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_blocker_hides_the_optional_packages():
    checks = "".join(
        f"\ntry:\n    import {name}\n    print('IMPORTED', {name!r})\nexcept ModuleNotFoundError:\n    pass\n"
        for name in EXTRAS
    )
    result = run_python(checks)
    assert result.returncode == 0, result.stderr
    assert "IMPORTED" not in result.stdout


def test_core_imports_and_trains_without_the_extras():
    result = run_python("import bam_pyro, bam_pyro.alignment, bam_pyro.training\n" + DENSE_STEP)
    assert result.returncode == 0, result.stderr
    assert "STEP OK" in result.stdout


INTEGRATIONS = {  # module: (the package it needs, the extra that brings it)
    "bam_pyro.pyg": ("torch_geometric", "pyg"),
    "bam_pyro.pyg.gat_conv": ("torch_geometric", "pyg"),
    "bam_pyro.transformers": ("transformers", "transformers"),
    "bam_pyro.diagnostics": ("arviz", "diagnostics"),
}


@pytest.fixture(scope="module")
def refusals() -> dict[str, str]:
    """The ImportError message of each integration, imported in one interpreter without its extra."""
    code = textwrap.dedent(
        f"""
        import importlib, json
        messages = {{}}
        for module in {list(INTEGRATIONS)!r}:
            try:
                importlib.import_module(module)
                messages[module] = None
            except ImportError as error:
                messages[module] = str(error)
        print(json.dumps(messages))
        """
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", list(INTEGRATIONS))
def test_an_integration_without_its_extra_says_so_in_one_line(refusals, module):
    package, extra = INTEGRATIONS[module]
    message = refusals[module]
    assert message is not None, f"{module} imported without {package}"
    assert "\n" not in message and package in message and f"pip install 'bam-pyro[{extra}]'" in message, message


def test_metrics_work_without_scipy_except_pavpu():
    code = textwrap.dedent(
        """
        import numpy as np
        from bam_pyro import metrics

        samples = np.random.default_rng(0).dirichlet(np.ones(3), size=(20, 10))  # [draws, items, classes]
        labels = np.arange(10) % 3
        mean = samples.mean(0)
        values = [metrics.accuracy(mean, labels), metrics.nll(mean, labels), metrics.brier(mean, labels),
                  metrics.expected_calibration_error(mean, labels), metrics.mutual_information(samples).mean()]
        assert all(np.isfinite(v) for v in values), values
        try:  # PAvPU's t-test is scipy's
            metrics.uncertainty_report(samples, labels)
        except ImportError as error:
            print("REFUSED", error)
        """
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    refusal = result.stdout.strip().splitlines()[-1]
    assert "scipy" in refusal and "pip install 'bam-pyro[diagnostics]'" in refusal, refusal


def test_import_bam_pyro_loads_no_optional_package():
    code = "import sys, bam_pyro\nprint(sorted({m.split('.')[0] for m in sys.modules} & set(%r)))" % sorted(EXTRAS)
    result = run_python(code, blocked=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"import bam_pyro loaded {result.stdout.strip()}"
