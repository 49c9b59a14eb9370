"""`train.onednn_linear`: the trainer's linears multiply through oneDNN on CPU and train like `F.linear`.

Tolerance: oneDNN and MKL sum fp32 products in other orders, so log-probs are compared at 1e-4 (absolute),
losses and grad norms at 1e-4 (relative), gradients at 1e-4 / 1e-3; the same setting run twice is exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from furlong.config.schema import TrainConfig
from furlong.core import onednn
from furlong.models import create_model, flops
from furlong.train import onednn_linear
from furlong.train.onednn_linear import OneDNNLinear
from furlong.train.trainer import Trainer
from tests.unit.test_train_compile import assert_trains_alike, two_steps
from tests.unit.test_train_trainer import algo

torch.set_num_threads(1)
MODEL = create_model("qwen3", "tiny")
pytestmark = pytest.mark.skipif(not onednn.available(torch.float32), reason="this torch build has no oneDNN linear")


@pytest.fixture
def calls(monkeypatch) -> list[tuple]:
    """Shapes of every oneDNN product (forward and backward) from here on, the MFU peak's probe aside."""
    flops.peak_flops("float32", "cpu")  # measured once per process: its products are not the model's
    seen: list[tuple] = []
    real = onednn.linear
    monkeypatch.setattr(onednn, "linear", lambda x, w, b=None: seen.append((x.shape, w.shape)) or real(x, w, b))
    return seen


def test_trainer_with_onednn_linears_trains_like_f_linear_within_1e_4(calls) -> None:
    plain, plain_rec, plain_grads, _ = two_steps(onednn_linear=False)
    assert not any(isinstance(m, OneDNNLinear) for m in plain.policy.modules()) and not calls
    fast, fast_rec, fast_grads, _ = two_steps(onednn_linear=True)
    n_linear = sum(isinstance(m, nn.Linear) for m in fast.policy.modules())
    assert n_linear and all(type(m) is OneDNNLinear for m in fast.policy.modules() if isinstance(m, nn.Linear))
    assert len(calls) >= 3 * n_linear  # forward, input gradient and weight gradient of every linear
    assert plain.policy.state_dict().keys() == fast.policy.state_dict().keys()  # checkpoints are unchanged
    assert_trains_alike((plain_rec, plain_grads), (fast_rec, fast_grads))
    again = two_steps(onednn_linear=True)[1]
    assert [r["train_logprobs"] for r in again] == [r["train_logprobs"] for r in fast_rec]  # exact run to run


@pytest.fixture
def vendor(monkeypatch):
    """Pretend to run on an x86 CPU whose vendor the test names: `vendor("AuthenticAMD")`."""
    from furlong.core import onednn

    monkeypatch.setattr(onednn.platform, "machine", lambda: "x86_64")
    onednn.mkl_slow_here.cache_clear()
    yield lambda name: (monkeypatch.setattr(onednn, "cpu_vendor", lambda: name), onednn.mkl_slow_here.cache_clear())
    onednn.mkl_slow_here.cache_clear()


@pytest.mark.parametrize(("cpu", "on"), [("AuthenticAMD", True), ("HygonGenuine", True), ("GenuineIntel", False)])
def test_auto_is_on_where_mkl_is_slow_and_bad_values_are_refused(vendor, cpu: str, on: bool) -> None:
    vendor(cpu)
    tr = Trainer(MODEL, TrainConfig(lr=1e-3), algo())  # onednn_linear defaults to auto
    assert any(isinstance(m, OneDNNLinear) for m in tr.policy.modules()) is on
    assert onednn_linear.wanted("auto", torch.device("cpu")) is on
    assert onednn_linear.wanted(True, torch.device("cpu")) and not onednn_linear.wanted(False, torch.device("cpu"))
    assert not onednn_linear.wanted(True, torch.device("meta"))  # oneDNN multiplies CPU tensors only
    with pytest.raises(ValueError, match="train.onednn_linear"):
        onednn_linear.wanted("yes", torch.device("cpu"))


def test_the_cpu_vendor_is_read_from_cpuinfo(tmp_path) -> None:
    from furlong.core import onednn

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nflags\t\t: fpu avx2\n")
    assert onednn.cpu_vendor(str(info)) == "AuthenticAMD"
    info.write_text("processor\t: 0\nFeatures\t: fp asimd\n")  # an ARM CPU's file names no vendor_id
    assert onednn.cpu_vendor(str(info)) == ""
    assert onednn.cpu_vendor(str(tmp_path / "missing")) == ""


@pytest.mark.parametrize("bias", [True, False])
def test_gradients_match_f_linear_and_frozen_weights_get_none(calls, bias: bool) -> None:
    torch.manual_seed(0)
    ref = nn.Linear(24, 40, bias=bias)
    fast = nn.Linear(24, 40, bias=bias)
    fast.load_state_dict(ref.state_dict())
    assert onednn_linear.apply(fast, True, torch.device("cpu")) == 1
    x = torch.randn(3, 5, 24)
    xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(3, 5, 40)
    (ref(xr) * g).sum().backward()
    (fast(xf) * g).sum().backward()
    torch.testing.assert_close(xf.grad, xr.grad, atol=1e-5, rtol=1e-5)
    for (n, pr), (_, pf) in zip(ref.named_parameters(), fast.named_parameters()):
        torch.testing.assert_close(pf.grad, pr.grad, atol=1e-5, rtol=1e-5, msg=n)
    assert len(calls) == 3
    fast.requires_grad_(False)  # a frozen reference: no weight-gradient product is computed
    xf.grad = None
    (fast(xf) * g).sum().backward()
    assert len(calls) == 3 + 2 and calls[-1][1] == (24, 40)  # forward and the input's gradient (w.T) only


def test_falls_back_to_f_linear_under_autocast(calls) -> None:
    layer = nn.Linear(16, 8)
    onednn_linear.apply(layer, True, torch.device("cpu"))
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and not calls  # autocast's cast-per-op belongs to F.linear
    assert layer(x).dtype == torch.float32 and len(calls) == 1
