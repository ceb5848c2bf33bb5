import json

import pytest
import torch

from lantern.decoding.trees import TREE_PRESETS, compile_tree, load_tree, validate_paths


def test_presets_have_the_documented_shapes():
    per_depth = lambda p: [sum(1 for q in p if len(q) == d) for d in range(1, max(map(len, p)) + 1)]  # noqa: E731
    assert per_depth(TREE_PRESETS["lantern++-57"]) == [5, 13, 16, 14, 9]
    assert len(TREE_PRESETS["eagle1-25"]) == 25 and len(TREE_PRESETS["wide-63"]) == 63
    assert max(max(p) for p in TREE_PRESETS["lantern++-57"]) == 4  # child ranks 0..4
    for paths in TREE_PRESETS.values():
        validate_paths(paths)


def test_compiled_buffers_are_consistent():
    t = compile_tree(TREE_PRESETS["lantern++-57"])
    assert t.size == 58 and t.depth == 5
    for i in range(1, t.size):
        par = int(t.parent[i])
        assert t.node_depth[i] == t.node_depth[par] + 1
        assert torch.equal(t.mask[i, :i], t.mask[par, :i]) and t.mask[i, i] and not t.mask[i, i + 1:].any()
        assert t.children[par][int(t.rank[i])] == i
    # every retrieve row is a root-to-leaf chain
    for row in t.retrieve:
        nodes = [int(n) for n in row if n >= 0]
        assert nodes[0] == 0 and all(int(t.parent[b]) == a for a, b in zip(nodes, nodes[1:]))


def test_padding_runs_a_small_tree_in_a_larger_shape():
    t = compile_tree(TREE_PRESETS["chain-5"], pad_to=26)
    assert t.size == 26 and t.n_real == 6
    assert torch.equal(t.mask[6:, :], torch.eye(26, dtype=torch.bool)[6:])  # padding sees only itself
    assert all(not t.children[i] for i in range(6, 26))


@pytest.mark.parametrize("paths, message", [
    ([[0], [0, 1, 0]], "not prefix-closed"),
    ([[0], [0]], "appears twice"),
    ([[0], [2]], "skips rank 1"),
    ([[0], [-1]], "child ranks"),
    ([], "at least one path"),
])
def test_invalid_trees_are_refused_with_the_reason(paths, message):
    with pytest.raises(ValueError, match=message):
        validate_paths(paths)


def test_limits_of_the_prepared_shape():
    with pytest.raises(ValueError, match="prepared maximum is 5"):
        compile_tree(TREE_PRESETS["chain-5"], pad_to=5)
    with pytest.raises(ValueError, match="depth 5 exceeds the prepared maximum 3"):
        validate_paths(TREE_PRESETS["chain-5"], max_depth=3)


def test_tree_from_a_json_file(tmp_path):
    f = tmp_path / "t.json"
    f.write_text(json.dumps([[0], [1], [0, 0]]))
    assert load_tree(str(f)) == ((0,), (1,), (0, 0))
    with pytest.raises(ValueError, match="neither a preset"):
        load_tree("no-such-tree")
