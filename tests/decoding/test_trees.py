import json

import pytest
import torch

from lantern.decoding.trees import TREE_PRESETS, compile_tree, load_tree, validate_paths


def test_every_preset_is_a_valid_tree_of_the_size_its_name_says():
    """A preset's name ends in its number of drafted nodes (what users pick by, and what the profile suite's
    verify sizes N = nodes + 1 are chosen for); a chain is one path per depth."""
    for name, paths in TREE_PRESETS.items():
        validate_paths(paths)  # prefix-closed, no duplicates, sibling ranks 0, 1, 2, ...
        assert len(set(paths)) == int(name.rsplit("-", 1)[1]), name
        if name.startswith("chain-"):
            assert sorted(paths) == [(0,) * d for d in range(1, len(paths) + 1)], name
        assert compile_tree(paths).size == len(paths) + 1


def test_lantern_pp_57_has_the_shape_docs_algorithms_md_gives_it():
    """docs/algorithms.md: "57 nodes over depth 5"; each node a candidate among the top 5 of its parent."""
    paths = TREE_PRESETS["lantern++-57"]
    t = compile_tree(paths)
    assert t.depth == 5 and t.size == 58 and {r for p in paths for r in p} == set(range(5))


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


@pytest.mark.parametrize("paths", [TREE_PRESETS["lantern++-57"], TREE_PRESETS["wide-63"],
                                   [(0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0), (2, 0), (2, 1), (2, 2)]])
def test_rows_at_rank_covers_every_parent_with_a_child_there_and_drops_only_by_half(paths):
    """Acceptance at child rank j reads the children table's first rows_at_rank[j] rows: every row with a j-th
    child is among them; the count never grows, and drops only where it at least halves (to the last row with a
    j-th child)."""
    t = compile_tree(paths)
    has = t.children_table >= 0  # (M, C)
    n = t.rows_at_rank
    assert len(n) == has.shape[1] and n[0] == has.shape[0]
    for j in range(has.shape[1]):
        assert not has[n[j]:, j].any(), j
        if j and n[j] < n[j - 1]:
            assert 2 * n[j] <= n[j - 1] and has[n[j] - 1, j], j


def test_a_branching_window_reads_its_wide_rows_only_near_the_root():
    """The widest counted window (fan 60, L 48, K 4, D 3): all 66 parents at rank 0, the root and its 20 branching
    descendants at ranks 1-3, the root alone for the fan's 60 ranks: 189 row-ranks where a full table is 4,224."""
    from lantern.decoding.jacobi import WindowTree
    t = WindowTree(window=48, branching=4, branch_depth=3, fan=60).compiled
    assert t.rows_at_rank == (66, 21, 21, 21) + (1,) * 60
    assert compile_tree(TREE_PRESETS["lantern++-57"]).rows_at_rank == (21,) * 5  # thins out slowly: read whole


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
