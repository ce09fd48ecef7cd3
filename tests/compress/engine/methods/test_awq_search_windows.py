"""AWQ's scale candidates run on whole windows strided over the calibration set: the windows one process picks
(``windows[::n // wanted][:wanted]``), every batch-shaped argument cut alike, the shared ones left whole."""

from __future__ import annotations

import torch

from compress.engine.methods.awq import _search_windows
from compress.engine.ranks import Ranks


def _call(first: int, batch: int, seq: int = 3, width: int = 2):
    """A recorded attention call whose every value is its global window index."""
    index = torch.arange(first, first + batch, dtype=torch.float32).reshape(-1, 1, 1)
    hidden = index.expand(batch, seq, width).clone()
    kwargs = {"position_embeddings": (hidden + 0.5, torch.zeros(1, seq, width)), "cache_position": torch.arange(seq)}
    return (hidden,), kwargs, -hidden


def test_windows_on_the_global_stride_with_their_arguments():
    calls = [_call(0, 4), _call(4, 4)]
    picked = _search_windows(calls, tokens=2 * 3, ranks=Ranks())  # 2 windows of 3 tokens of 8: stride 4
    assert [args[0][:, 0, 0].tolist() for args, _, _ in picked] == [[0.0], [4.0]]
    for (hidden,), kwargs, reference in picked:
        cos, sin = kwargs["position_embeddings"]
        assert torch.equal(cos, hidden + 0.5) and torch.equal(reference, -hidden)
        assert sin.shape == (1, 3, 2) and torch.equal(kwargs["cache_position"], torch.arange(3))  # shared: whole


def test_hidden_states_passed_by_name():
    (hidden,), kwargs, reference = _call(0, 4)
    picked = _search_windows([((), {"hidden_states": hidden, **kwargs}, reference)], tokens=2 * 3, ranks=Ranks())
    assert picked[0][1]["hidden_states"][:, 0, 0].tolist() == [0.0, 2.0]


def test_calls_without_a_picked_window_are_dropped_and_whole_calls_kept():
    calls = [_call(i, 1) for i in range(6)]
    picked = _search_windows(calls, tokens=3 * 3, ranks=Ranks())  # stride 2: windows 0, 2, 4
    assert [args[0][0, 0, 0].item() for args, _, _ in picked] == [0.0, 2.0, 4.0]
    assert all(p[0][0] is calls[i][0][0] for p, i in zip(picked, (0, 2, 4)))  # not copied


def test_routed_token_rows_are_units():
    rows = torch.arange(10, dtype=torch.float32).unsqueeze(1).expand(10, 4).clone()
    picked = _search_windows([((rows,), {}, rows * 2)], tokens=5, ranks=Ranks())
    assert picked[0][0][0][:, 0].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert torch.equal(picked[0][2], picked[0][0][0] * 2)


def test_all_tokens_when_asked_or_when_fewer_are_recorded():
    calls = [_call(0, 4)]
    assert _search_windows(calls, tokens=0, ranks=Ranks()) is calls
    assert _search_windows(calls, tokens=100, ranks=Ranks()) is calls
