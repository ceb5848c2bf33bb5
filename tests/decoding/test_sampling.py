"""Finding tokens in a support: the per-code table a wide support uses, and the comparison a narrow one uses, read
what the sorted search reads."""
import torch

from lantern.decoding.sampling import Support, SupportLookup


def test_a_wide_supports_table_finds_every_token_the_sorted_search_finds():
    """Supports of 40 of 64 codes (wide enough for the table) in descending order, queried at tokens on and off
    the support: the same index, found flag and probability either way; index 0 where a token is not found."""
    torch.manual_seed(0)
    ids = torch.rand(3, 5, 64).argsort(-1)[..., :40]
    probs = torch.softmax(torch.randn(3, 5, 40), -1).sort(-1, descending=True).values
    support, tokens = Support(probs, ids), torch.randint(0, 64, (3, 5, 70))
    table, search = support.lookup(64), support.lookup()
    assert table.index_of is not None and search.index_of is None  # the two ways really ran
    (at_t, found_t), (at_s, found_s) = table.position(tokens), search.position(tokens)
    assert 0 < int(found_t.sum()) < found_t.numel()  # tokens on and off the support
    assert torch.equal(found_t, found_s) and torch.equal(at_t, at_s) and at_t.dtype == torch.long
    assert torch.equal(table.prob(tokens), search.prob(tokens))
    assert torch.equal(ids.gather(-1, at_t)[found_t], tokens[found_t])


def test_a_narrow_supports_comparison_finds_every_token_the_sorted_search_finds(monkeypatch):
    """Top-5 supports (narrow: compared, nothing sorted) queried at tokens on and off the support, one and many
    per row: the same index, found flag and probability as the sorted search (forced by a narrow limit of 0)."""
    torch.manual_seed(1)
    ids = torch.rand(3, 5, 64).argsort(-1)[..., :5]
    probs = torch.softmax(torch.randn(3, 5, 5), -1).sort(-1, descending=True).values
    support = Support(probs, ids)
    compared = support.lookup(64)
    monkeypatch.setattr(SupportLookup, "NARROW", 0)
    search = support.lookup(64 * 64)  # a vocabulary too large for the table: the sorted search
    assert compared.narrow and search.sorted_ids is not None  # the two ways really ran
    tokens = torch.randint(0, 64, (3, 5, 70))
    assert 0 < int(compared.position(tokens)[1].sum()) < tokens.numel()  # tokens on and off the support
    for tokens in (tokens, ids.flip(-1), tokens[..., :1]):
        (at_c, found_c), (at_s, found_s) = compared.position(tokens), search.position(tokens)
        assert torch.equal(found_c, found_s) and torch.equal(at_c, at_s) and at_c.dtype == torch.long
        assert torch.equal(compared.prob(tokens), search.prob(tokens))
