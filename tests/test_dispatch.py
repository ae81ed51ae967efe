"""The dispatcher's grouping of rows by destination, checked against a plain Python reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from amoe import core


def group_by_destination_reference(dest: list[int], num_dest: int) -> tuple[list[int], list[int]]:
    buckets = [[i for i, d in enumerate(dest) if d == k] for k in range(num_dest)]
    offsets = [0]
    for bucket in buckets:
        offsets.append(offsets[-1] + len(bucket))
    return [i for bucket in buckets for i in bucket], offsets


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 16).flatmap(lambda n: st.tuples(st.just(n), st.lists(st.integers(0, n - 1), max_size=300)))
)
def test_matches_python_reference(case):
    num_dest, dest = case
    perm, offsets = core.group_by_destination(torch.tensor(dest, dtype=torch.int64), num_dest)
    want_perm, want_offsets = group_by_destination_reference(dest, num_dest)
    assert perm.tolist() == want_perm
    assert offsets.tolist() == want_offsets


def test_rows_of_each_destination_keep_their_order():
    dest = torch.tensor([3, 1, 3, 0, 1, 3])
    perm, offsets = core.group_by_destination(dest, 4)
    rows_of_3 = perm[offsets[3] : offsets[4]].tolist()
    assert rows_of_3 == [0, 2, 5]


@pytest.mark.parametrize(
    ("dest", "num_dest", "message"),
    [
        (torch.tensor([0, 4]), 4, "outside"),
        (torch.tensor([-1]), 2, "outside"),
        (torch.tensor([[0]]), 2, "1-D"),
        (torch.tensor([0], dtype=torch.int32), 2, "int64"),
        (torch.tensor([0]), 0, "positive"),
    ],
)
def test_bad_input_is_a_value_error_with_location(dest, num_dest, message):
    with pytest.raises(ValueError, match=message) as info:
        core.group_by_destination(dest, num_dest)
    assert "dispatch.cpp:" in str(info.value)
