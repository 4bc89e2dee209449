"""Planted bugs apply for their block only, in this process and on every rank of the pool."""

import pytest

from paritykit.harness import plants
from paritykit.harness.patching import replaced


class Base:
    def value(self):
        return 1


class Derived(Base):
    pass


def test_replaced_restores_an_own_attribute_and_removes_an_inherited_one():
    with replaced(Base, "value", lambda original: lambda self: original(self) + 10):
        assert Derived().value() == 11
    assert Derived().value() == 1 and "value" in vars(Base)
    with replaced(Derived, "value", lambda original: lambda self: 5):
        assert Derived().value() == 5 and Base().value() == 1
    assert "value" not in vars(Derived)


def test_applied_tracks_active_plants_and_rejects_unknown_names():
    with plants.applied(["tolist-in-ebc-forward"]):
        assert plants.active() == ("tolist-in-ebc-forward",)
    assert plants.active() == ()
    with pytest.raises(KeyError, match="unknown planted bug"):
        with plants.applied(["no-such-bug"]):
            pass


def rank_sees_plant():
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    return EmbeddingBagCollection.forward.__name__


@pytest.mark.world_size(2)
def test_a_plant_reaches_every_rank_for_the_call_only(rank_pool):
    with plants.applied(["tolist-in-ebc-forward"]):
        assert rank_pool.run(rank_sees_plant) == ["forward_with_planted_tolist"] * 2
    assert rank_pool.run(rank_sees_plant) == ["forward"] * 2
