"""The model zoo: exact shapes, named modules, no downloads."""

import torch

from silo_pfl.models import build_model


def test_cnn_small_has_exactly_the_specified_shape():
    model = build_model("cnn_small", (1, 8, 8), 10)
    body = dict(model.body.named_children())
    assert (body["conv1"].in_channels, body["conv1"].out_channels) == (1, 16)
    assert body["conv1"].kernel_size == (3, 3) and body["conv1"].padding == (1, 1)
    assert (body["conv2"].in_channels, body["conv2"].out_channels) == (16, 32)
    assert body["pool"].output_size == 2
    assert (body["fc"].in_features, body["fc"].out_features) == (128, 64)
    assert (model.head.in_features, model.head.out_features) == (64, 10)
    assert model(torch.zeros(5, 1, 8, 8)).shape == (5, 10)
    assert not any("BatchNorm" in type(m).__name__ for m in model.modules())


def test_cnn_small_bn_adds_batchnorm_to_every_body_layer():
    model = build_model("cnn_small_bn", (1, 8, 8), 10)
    norms = [n for n, m in model.named_modules() if "BatchNorm" in type(m).__name__]
    assert norms == ["body.bn1", "body.bn2", "body.bn3"]
    assert model(torch.zeros(4, 1, 8, 8)).shape == (4, 10)


def test_mlp_and_resnet18_forward():
    mlp = build_model("mlp", (13,), 2, hidden=(32, 16))
    assert mlp(torch.zeros(3, 13)).shape == (3, 2)
    assert [n for n, _ in mlp.body.named_children()] == ["flatten", "fc1", "relu1", "fc2", "relu2"]
    resnet = build_model("resnet18", (3, 32, 32), 10)
    assert resnet(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_a_new_adapter_is_the_identity():
    plain = build_model("cnn_small", (1, 8, 8), 10)
    adapted = build_model("cnn_small", (1, 8, 8), 10, adapter_dim=4)
    missing, unexpected = adapted.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all(".adapter" in k for k in missing)
    x = torch.randn(5, 1, 8, 8)
    torch.testing.assert_close(adapted(x), plain(x))
    mlp = build_model("mlp", (13,), 2, hidden=(32, 16), adapter_dim=8)
    assert [n for n, _ in mlp.body.named_children() if n.startswith("adapter")] == [
        "adapter1",
        "adapter2",
    ]
