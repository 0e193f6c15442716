from train.distill import parts


def test_parts_sort_all_prompts_or_only_within_each_part():
    lengths = [5, 1, 9, 3, 7, 2, 8]
    items = [(f"c{i}", [0] * n) for i, n in enumerate(lengths)]
    size = lambda part: [len(ids) for _, ids in part]  # noqa: E731

    assert [size(p) for p in parts(items, 3, "all")] == [[1, 2, 3], [5, 7, 8], [9]]
    # Each part holds the same prompts as that slice of the source order: later parts keep long and short ones.
    assert [size(p) for p in parts(items, 3, "part")] == [[1, 5, 9], [2, 3, 7], [8]]
    assert [cid for p in parts(items, 3, "part") for cid, _ in p] == ["c1", "c0", "c2", "c5", "c3", "c4", "c6"]
