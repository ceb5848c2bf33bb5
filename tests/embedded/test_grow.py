"""Growing a target by layer duplication keeps its function exactly, and the copies can learn."""
import torch

from lantern.models.config import gpt_preset
from lantern.models.gpt import GPT
from lantern.embedded.train.grow import grow_by_duplication, grown_config


def test_grown_model_gives_the_same_logits():
    torch.manual_seed(0)
    source = GPT(gpt_preset("GPT-test")).eval()
    grown = GPT(grown_config(source.config)).eval()
    grown.load_state_dict(grow_by_duplication(source.state_dict()))  # strict: every key of 2n layers present
    assert grown.config.n_layer == 2 * source.config.n_layer
    tokens = torch.randint(0, source.config.vocab_size, (3, source.config.block_size))
    cond = torch.tensor([0, 2, source.config.null_class])
    with torch.no_grad():
        expected, _ = source.forward_full(tokens, cond)
        got, _ = grown.forward_full(tokens, cond)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert torch.equal(grown.layers[1].attention.wqkv.weight, source.layers[0].attention.wqkv.weight)
    assert torch.count_nonzero(grown.layers[1].attention.wo.weight) == 0


def test_duplicate_layers_receive_gradient():
    torch.manual_seed(0)
    source = GPT(gpt_preset("GPT-test"))
    grown = GPT(grown_config(source.config))
    grown.load_state_dict(grow_by_duplication(source.state_dict()))
    tokens = torch.randint(0, source.config.vocab_size, (2, source.config.block_size))
    logits, _ = grown.forward_full(tokens, torch.tensor([0, 1]))
    logits.logsumexp(-1).mean().backward()
    assert grown.layers[1].feed_forward.w2.weight.grad.abs().sum() > 0
