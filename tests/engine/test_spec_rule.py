"""The acceptance arithmetic of `bench/spec_rule.py` (the engine's exact matching under shared Gumbel
noise against the standard min(1, p/q) rule), on distributions checked by hand."""

import pytest
import torch

from bench.spec_rule import expected_accepted, gumbel_agreement, standard_acceptance
from tailrace.engine.sampler import gumbel_noise, vocab_salt


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_standard_rule_accepts_sum_of_minima():
    p, q = t([0.5, 0.3, 0.2], [1.0, 0.0, 0.0]), t([0.2, 0.3, 0.5], [0.5, 0.5, 0.0])
    assert standard_acceptance(p, q).tolist() == pytest.approx([0.7, 0.5])  # 1 - TV


def test_gumbel_agreement_by_hand():
    # x=0: .10 / (.10 + .15 + .25); x=1: .09 / (.15 + .09 + .15); x=2: .10 / (.25 + .15 + .10)
    p, q = t([0.5, 0.3, 0.2]), t([0.2, 0.3, 0.5])
    assert gumbel_agreement(p, q).item() == pytest.approx(0.2 + 0.09 / 0.39 + 0.2)  # 0.631 < 0.7
    # two tokens: the coupling is maximal; equal distributions always agree; disjoint ones never do
    assert gumbel_agreement(t([0.8, 0.2]), t([0.2, 0.8])).item() == pytest.approx(0.4)
    assert gumbel_agreement(t([0.3, 0.7]), t([0.3, 0.7])).item() == pytest.approx(1.0)
    assert gumbel_agreement(t([1.0, 0.0]), t([0.0, 1.0])).item() == 0.0


def test_point_mass_draft_is_accepted_with_p_of_x_under_both_rules():
    p, q = t([0.5, 0.3, 0.2]), t([0.0, 1.0, 0.0])
    assert gumbel_agreement(p, q).item() == pytest.approx(0.3)
    assert standard_acceptance(p, q).item() == pytest.approx(0.3)


def test_gumbel_agreement_is_what_the_engine_noise_gives():
    """The closed form against 20,000 draws of the sampler's own noise (a fixed hash: deterministic;
    binomial sd 0.0034, the tolerance 0.015 is 4.4 sd)."""
    V, n = 6, 20_000
    gen = torch.Generator().manual_seed(0)
    p, q = torch.rand(V, generator=gen).pow(3), torch.rand(V, generator=gen).pow(3)
    p, q = p / p.sum(), q / q.sum()
    g = gumbel_noise(torch.full((n,), 12345), torch.arange(n), vocab_salt(V))
    agree = ((p.log() + g).argmax(-1) == (q.log() + g).argmax(-1)).double().mean().item()
    closed = gumbel_agreement(p[None], q[None]).item()
    assert agree == pytest.approx(closed, abs=0.015)
    tv = 0.5 * (p - q).abs().sum().item()
    assert (1 - tv) / (1 + tv) <= closed <= 1 - tv + 1e-9  # the coupling bound, and the maximal coupling


def test_expected_accepted_drafts_of_a_verify():
    assert expected_accepted([]) == 0.0
    assert expected_accepted([1.0, 1.0, 1.0]) == 3.0
    assert expected_accepted([0.5, 0.5]) == pytest.approx(0.5 + 0.25)
    assert expected_accepted([0.9, 0.0, 1.0]) == pytest.approx(0.9)  # nothing past a sure rejection


def test_coupling_sits_between_its_bound_and_the_maximal_coupling():
    """On random pairs: (1 - TV) / (1 + TV) <= Gumbel agreement <= 1 - TV, with equality on the right
    for two tokens (the coupling is maximal there)."""
    gen = torch.Generator().manual_seed(1)
    for V in (2, 3, 7, 50):
        p, q = (
            torch.rand(64, V, generator=gen, dtype=torch.float64).pow(4),
            torch.rand(64, V, generator=gen).double(),
        )
        p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
        closed, std = gumbel_agreement(p, q), standard_acceptance(p, q)
        assert (closed <= std + 1e-12).all() and (closed >= std / (2 - std) - 1e-12).all()
        if V == 2:
            assert closed.tolist() == pytest.approx(std.tolist())
        else:
            assert (closed < std - 1e-6).any()
