"""The grouped-query attention path (query heads stacked per KV head for few tokens per stream) gives
what torch's own GQA gives, for every number of tokens per stream on either side of the switch."""
import pytest
import torch
import torch.nn.functional as F

from engine.models.transformer import GROUPED_MAX_TOKENS, grouped_query_attention


@pytest.mark.parametrize("n_tokens", [1, 3, GROUPED_MAX_TOKENS, GROUPED_MAX_TOKENS + 1])
@pytest.mark.parametrize("n_head, n_head_kv", [(12, 4), (4, 4), (8, 1)])
def test_grouped_attention_equals_repeated_kv(n_tokens, n_head, n_head_kv):
    gen = torch.Generator().manual_seed(n_tokens * 100 + n_head + n_head_kv)
    G, D, n_kv = 2, 16, 40
    q = torch.randn(G, n_tokens, n_head, D, generator=gen).transpose(1, 2)  # strided, as the model has it
    rows_k = torch.randn(G, n_kv, n_head_kv * D, generator=gen)
    rows_v = torch.randn(G, n_kv, n_head_kv * D, generator=gen)
    keys = rows_k.view(G, n_kv, n_head_kv, D).transpose(1, 2)  # cache rows read in place
    values = rows_v.view(G, n_kv, n_head_kv, D).transpose(1, 2)
    mask = torch.rand(G, 1, n_tokens, n_kv, generator=gen) > 0.4
    mask[..., 0] = True  # every token sees one cell at least
    rep = n_head // n_head_kv
    expected = F.scaled_dot_product_attention(q, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1),
                                              attn_mask=mask, scale=0.3)
    got = grouped_query_attention(q, keys, values, mask, 0.3)
    assert got.shape == (G, n_head, n_tokens, D)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # a token's output depends on its own mask row only: changing another token's row leaves it alone
    if n_tokens > 1:
        mask2 = mask.clone()
        mask2[:, :, 1:, 1:] = ~mask2[:, :, 1:, 1:]
        got2 = grouped_query_attention(q, keys, values, mask2, 0.3)
        torch.testing.assert_close(got2[:, :, 0], got[:, :, 0])
        assert not torch.allclose(got2[:, :, 1:], got[:, :, 1:])
