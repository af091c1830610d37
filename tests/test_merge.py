"""The float32 lse merge against logaddexp, with rows that saw no key."""
import torch

from longattn._merge import merge_


def test_merge_matches_logaddexp_and_handles_empty_rows():
    o, ob = torch.randn(2, 5, 3, 4), torch.randn(2, 5, 3, 4)
    l, lb = torch.randn(2, 5, 3) * 30, torch.randn(2, 5, 3) * 30  # large gaps: stability
    l[0, 0, 0] = float("-inf")                                      # a saw nothing
    lb[0, 0, 1] = float("-inf")                                     # b saw nothing
    l[1, 1, 1] = lb[1, 1, 1] = float("-inf")                        # neither
    o[0, 0, 0] = o[1, 1, 1] = ob[0, 0, 1] = ob[1, 1, 1] = 0.0      # empty rows carry 0
    want_l = torch.logaddexp(l.double(), lb.double())
    fin = torch.isfinite(want_l)
    wa = torch.exp(l.double() - want_l).nan_to_num(0.0)[..., None]
    wb = torch.exp(lb.double() - want_l).nan_to_num(0.0)[..., None]
    want_o = torch.where(fin[..., None], o.double() * wa + ob.double() * wb, 0.0)
    merge_(o, l, ob, lb)
    assert not torch.isnan(o).any() and not torch.isnan(l).any()
    assert torch.equal(torch.isneginf(l), ~fin)
    assert torch.allclose(l[fin].double(), want_l[fin], atol=1e-5)
    assert torch.allclose(o.double(), want_o, atol=1e-6)
