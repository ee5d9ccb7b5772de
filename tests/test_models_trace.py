"""The traced cut (``hetrain.models.trace``): what travels across a cut, modes, devices, and refusals."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import fx, nn  # noqa: E402

from hetrain.models.layers import run_layers  # noqa: E402
from hetrain.models.spec import SpecError  # noqa: E402
from hetrain.models.trace import check_cut, repeated_blocks, trace_cut  # noqa: E402


class Net(nn.Module):
    """A stem, two blocks each with a residual around it, a head; dropout; positions made with arange."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)])
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)                                                   # (B, T, 8)
        pos = torch.arange(x.shape[1], dtype=h.dtype).unsqueeze(-1)       # (T, 1): made on the device of x
        for block in self.blocks:
            h = h + block(h) + pos
        return self.head(self.drop(h)) * 2.0


def test_a_residual_and_positions_travel_and_the_chain_is_the_forward() -> None:
    torch.manual_seed(0)
    net = Net()
    cut = trace_cut(net, (torch.randn(2, 5, 4),), repeated_blocks(net), what="net")
    assert cut.names == ("embed", "blocks.0", "blocks.1", "head") and len(cut.layers) == 4
    # after layer 0: the hidden state and the positions, each block needs both; the last block's residual sum
    # runs at the model's level after it, so in the head: the block's input and output cross to it
    assert [len(c) for c in cut.crossing] == [2, 2, 3]
    net.eval()
    for layer in cut.layers:
        layer.eval()
    x = torch.randn(3, 7, 4)  # another batch and sequence size than the trace's
    torch.testing.assert_close(run_layers(cut.layers, x), net(x), rtol=0, atol=0)
    check_cut(cut, net, (x,), lambda m, a: m(a), "net")  # passes: no exception


def test_dropout_follows_the_layers_mode() -> None:
    torch.manual_seed(0)
    net = Net()
    cut = trace_cut(net, (torch.randn(2, 5, 4),), repeated_blocks(net), what="net")
    x = torch.randn(2, 5, 4)
    for layer in cut.layers:
        layer.train()
    assert not torch.equal(run_layers(cut.layers, x), run_layers(cut.layers, x))  # p = 0.5: two draws differ
    for layer in cut.layers:
        layer.eval()
    torch.testing.assert_close(run_layers(cut.layers, x), net.eval()(x), rtol=0, atol=0)


def test_factory_ops_make_tensors_where_the_layer_runs() -> None:
    """A graph traced on the CPU would create its arange on the CPU wherever it ran: the device is read from the
    layer's input instead."""
    net = Net()
    cut = trace_cut(net, (torch.randn(2, 5, 4),), repeated_blocks(net), what="net")
    factories = [n for layer in cut.layers for n in layer.graph.nodes
                 if n.op == "call_function" and "device" in n.kwargs]
    assert factories, "the trace has no factory op to check"
    assert all(isinstance(n.kwargs["device"], fx.Node) for n in factories)
    x = torch.randn(2, 5, 4, device="meta")
    out = run_layers([layer.to("meta") for layer in cut.layers], x)
    assert out.device.type == "meta"


def test_a_cut_that_differs_from_the_forward_is_refused_naming_the_first_layer() -> None:
    torch.manual_seed(0)
    net = Net()
    cut = trace_cut(net, (torch.randn(2, 5, 4),), repeated_blocks(net), what="net")
    block = cut.layers[2].get_submodule("blocks.1.0")  # layer 2 no longer holds the model's own weight
    block.weight = nn.Parameter(block.weight.detach() + 0.1)
    with pytest.raises(SpecError) as info:
        check_cut(cut, net, (torch.randn(2, 5, 4),), lambda m, a: m(a), "net")
    assert "net: the cut layers differ from the model's own forward by" in str(info.value)
    assert "the first to differ is layer 2 (blocks.1)" in str(info.value)
