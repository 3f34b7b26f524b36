"""kernels.residual_spec is the residual variants' one home: the list, the `VARIANT:N[:K]` spelling and its parser,
the labels and coefficient counts that the layers (MHCConfig) and the cost model (ResidualSpec) both read."""
from __future__ import annotations

import pytest

from kernels import residual_spec as rs
from kernels.config import VARIANTS, MHCConfig


def test_one_list_of_variants_everywhere():
    from costmodel.physics.mhc_cost import VARIANTS as COST_VARIANTS

    assert rs.NAMES == VARIANTS == COST_VARIANTS == ("residual", "hc", "mhc", "mhc-lite", "mhc-sp", "xhc")


@pytest.mark.parametrize("text,want", [("mhc:4", ("mhc", 4, None)), ("xhc:16:4", ("xhc", 16, 4)),
                                       ("residual:1", ("residual", 1, None)), ("mhc-lite:3", ("mhc-lite", 3, None))])
def test_the_one_spelling_round_trips_through_its_label(text, want):
    assert rs.parse(text) == want
    assert rs.label(*want) == text
    cfg = MHCConfig(variant=want[0], n=want[1], **({"active": want[2]} if want[2] else {}))
    assert cfg.label == text


@pytest.mark.parametrize("text,needle", [("mhc", "use VARIANT:N"), ("mhc:4:2", "only xhc takes N:K"),
                                         ("residual:2", "one stream"), ("mhc-lite:5", "n <= 4"),
                                         ("xhc:4:5", "1 <= k <= n"), ("bogus:4", "is unknown")])
def test_bad_spellings_say_what_is_wrong(text, needle):
    with pytest.raises(ValueError, match=needle):
        rs.parse(text)


def test_the_layers_and_the_cost_model_count_the_same_coefficients():
    """The cost model prices per-token coefficients of one sub-layer: the layer's projection width (hc: per stream,
    n of them); mhc-lite's n! and xhc's k^2 come from the same facts."""
    from costmodel.physics.mhc_cost import ResidualSpec

    for variant, n, k in (("mhc", 4, None), ("hc", 4, None), ("mhc-lite", 4, None), ("mhc-sp", 4, None),
                          ("xhc", 16, 4)):
        cost = ResidualSpec(variant, n, k).num_mix
        assert cost == rs.num_mix(variant, n, k)
        if variant == "hc":
            assert cost == n * MHCConfig(variant="hc", n=n).num_mix  # per stream x streams
        elif variant in ("mhc", "mhc-lite", "mhc-sp"):
            assert cost == MHCConfig(variant=variant, n=n).num_mix
