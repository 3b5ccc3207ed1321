import torch

from conftest import make_tiny
from k3.model.decoder import KimiDecoderLayer
from k3.model.k3 import lm_loss


def test_two_mtp_layers_chain_pre_norm_states():
    """Layer 2 reads layer 1's pre-norm output (vLLM's K3 MTP chaining); each layer's logits are
    lm_head(shared_head.norm(h_k)); mtp_loss is the mean of the per-layer losses (shift 1 + k)."""
    model = make_tiny(seed=3, num_nextn_predict_layers=2)
    model.language_model.loss_impl = "plain"
    x = torch.randint(0, 4000, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = model(input_ids=x, labels=x)
        lm = model.language_model
        emb, h = lm.model.embed_tokens(x), out.hidden_states
        losses, wrong = [], []
        for normed_chain, acc in ((False, losses), (True, wrong)):
            h = out.hidden_states
            for k, layer in enumerate(lm.model.mtp_layers, start=1):
                nxt = torch.cat([emb[:, k:], emb.new_zeros(2, k, emb.shape[2])], dim=1)
                z = KimiDecoderLayer.forward(layer, layer.eh_proj(torch.cat([layer.enorm(nxt), layer.hnorm(h)], -1)))
                hn = layer.shared_head.norm(z)
                acc.append(lm_loss(lm.lm_head(hn), x, shift=1 + k))
                h = hn if normed_chain else z
    assert len(lm.model.mtp_layers) == 2
    assert torch.allclose(out.mtp_loss, torch.stack(losses).mean(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(torch.stack(losses).mean(), torch.stack(wrong).mean(), rtol=1e-4)
