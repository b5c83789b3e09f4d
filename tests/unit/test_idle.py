"""core/idle.py: which models sleep and what they keep; server.yaml's checks of the keys."""

from __future__ import annotations

import msgspec
import pytest

from llmgw import config
from llmgw.core.catalog import CatalogError, catalog_from_config
from llmgw.core.idle import awake_catalog, is_idle, merged


def _catalog(*models: dict):
    return catalog_from_config(msgspec.convert(
        [{"profiles": [{"engine": "sim"}], **m} for m in models], list[config.Model]))


def test_an_idle_model_keeps_its_min_replicas_and_the_others_are_untouched() -> None:
    catalog = _catalog(
        {"name": "nap", "replicas": 3, "idle_unload_s": 60, "min_replicas": 1},
        {"name": "never", "replicas": 2},
        {"name": "off", "replicas": 0, "idle_unload_s": 60})
    awake, asleep = awake_catalog(catalog, {"nap": 1000.0}, 1059.9)
    assert (awake, asleep) == (catalog, frozenset())  # nothing idle: the same catalog
    awake, asleep = awake_catalog(catalog, {"nap": 1000.0}, 1060.0)
    assert asleep == {"nap"}  # scaled to 0 by hand, "off" has nothing to unload
    assert [(m.name, m.replicas) for m in awake.models] == [("nap", 1), ("never", 2),
                                                           ("off", 0)]
    assert awake.get("nap").idle_unload_s == 60  # the rest of the model as declared


def test_a_model_never_asked_for_is_idle_from_the_start() -> None:
    [nap] = _catalog({"name": "nap", "idle_unload_s": 5}).models
    assert is_idle(nap, None, 0.0)
    assert not is_idle(nap, 10.0, 14.0) and is_idle(nap, 10.0, 15.0)
    [plain] = _catalog({"name": "plain"}).models
    assert not is_idle(plain, None, 1e9)


def test_the_latest_time_of_each_model_wins() -> None:
    assert merged({"a": 5.0, "b": 9.0}, {"a": 7.0}, {"c": 1.0}) == {"a": 7.0, "b": 9.0,
                                                                  "c": 1.0}


@pytest.mark.parametrize(("model", "words"), [
    ({"min_replicas": 1}, "models[0].min_replicas is set but idle_unload_s is not"),
    ({"idle_unload_s": 60, "min_replicas": 2}, "models[0].min_replicas (2) is over replicas (1)"),
])
def test_sleep_settings_that_cannot_work_are_refused_naming_the_key(model, words) -> None:
    with pytest.raises(CatalogError) as refused:
        _catalog({"name": "m", **model})
    assert str(refused.value).startswith(words), refused.value


def test_a_sleep_time_must_be_positive() -> None:
    with pytest.raises(msgspec.ValidationError, match="idle_unload_s"):
        msgspec.convert({"name": "m", "profiles": [{"engine": "sim"}], "idle_unload_s": 0},
                        config.Model)
