"""Model aliases: the names a catalog entry answers to besides its own. How a name a client
sends resolves to a model, which keys may send it, and the refusals of aliases that would
make one name mean two models, as server.yaml and POST /api/models read them. And the
body an alias's request is forwarded with: it names the model, as its engine serves it."""

from __future__ import annotations

import msgspec
import multipart
import pytest
import yaml

from llmgw import config
from llmgw.config import ServerConfig, parse
from llmgw.core.catalog import Catalog, CatalogError, catalog_from_config, may_use
from llmgw.server.catalog import ModelError, parse_model
from llmgw.server.openai.admission import form_with_model, json_with_model

SIM = "profiles: [{engine: sim}]"


def models_of(text: str) -> list[config.Model]:
    return parse(yaml.safe_load(text), ServerConfig).models


def catalog_of(text: str) -> Catalog:
    return catalog_from_config(models_of(text))


def refusal_of(text: str) -> str:
    with pytest.raises(CatalogError) as caught:
        catalog_of(text)
    return str(caught.value)


CATALOG = f"""
models:
  - name: qwen3-8b
    aliases: [gpt-4o-mini, openai/gpt-4o-mini]
    {SIM}
  - name: sim-b
    {SIM}
"""


def test_a_name_or_an_alias_resolves_to_the_model() -> None:
    catalog = catalog_of(CATALOG)
    qwen = catalog.get("qwen3-8b")
    assert qwen is not None and qwen.aliases == ("gpt-4o-mini", "openai/gpt-4o-mini")
    assert catalog.resolve("qwen3-8b") is qwen
    assert catalog.resolve("gpt-4o-mini") is qwen
    assert catalog.resolve("openai/gpt-4o-mini") is qwen
    assert catalog.resolve("sim-b") is catalog.get("sim-b")
    assert catalog.resolve("gpt-4o") is None
    # An alias is not a name: the controller, placement and metrics look up names only.
    assert catalog.get("gpt-4o-mini") is None
    assert catalog.names() == ["qwen3-8b", "sim-b"]


def test_served_names_list_each_model_then_its_aliases() -> None:
    served = [(n.name, n.model.name) for n in catalog_of(CATALOG).served_names()]
    assert served == [("qwen3-8b", "qwen3-8b"), ("gpt-4o-mini", "qwen3-8b"),
                      ("openai/gpt-4o-mini", "qwen3-8b"), ("sim-b", "sim-b")]


def test_a_key_may_send_an_alias_when_its_list_names_the_model_or_that_alias() -> None:
    qwen = catalog_of(CATALOG).get("qwen3-8b")
    assert qwen is not None
    assert may_use(None, "gpt-4o-mini", qwen)  # a key with no list: every model
    assert may_use(["qwen3-8b"], "gpt-4o-mini", qwen)  # the model: all its names
    assert may_use(["qwen3-8b"], "qwen3-8b", qwen)
    assert may_use(["gpt-4o-mini"], "gpt-4o-mini", qwen)  # the alias: by that alias
    assert not may_use(["gpt-4o-mini"], "qwen3-8b", qwen)  # ... only
    assert not may_use(["gpt-4o-mini"], "openai/gpt-4o-mini", qwen)
    assert not may_use(["sim-b"], "gpt-4o-mini", qwen)


@pytest.mark.parametrize(("text", "words"), [
    (f"""
models:
  - name: qwen3-8b
    aliases: [sim-b]
    {SIM}
  - name: sim-b
    {SIM}
""", "models[1].name: name 'sim-b' of model 'sim-b' is already an alias of model "
     "'qwen3-8b'"),
    (f"""
models:
  - name: sim-b
    {SIM}
  - name: qwen3-8b
    aliases: [gpt-4o-mini, sim-b]
    {SIM}
""", "models[1].aliases[1]: alias 'sim-b' of model 'qwen3-8b' is already model 'sim-b'"),
    (f"""
models:
  - name: qwen3-8b
    aliases: [gpt-4o-mini]
    {SIM}
  - name: llama
    aliases: [gpt-4o-mini]
    {SIM}
""", "models[1].aliases[0]: alias 'gpt-4o-mini' of model 'llama' is already an alias of "
     "model 'qwen3-8b'"),
])
def test_an_alias_that_is_another_models_name_or_alias_is_refused_naming_both(
        text: str, words: str) -> None:
    refusal = refusal_of(text)
    assert refusal.startswith(words), refusal
    assert "each name a client may send must name one model" in refusal


@pytest.mark.parametrize(("aliases", "words"), [
    ("[qwen3-8b]", "models[0].aliases[0]: 'qwen3-8b' is the model's own name; drop it"),
    ("[a, b, a]", "models[0].aliases[2]: 'a' is listed twice; drop it"),
    ("['../x']", "models[0].aliases[0]: model name '../x' is not allowed"),
    ("['']", "models[0].aliases[0]: model name '' is not allowed"),
])
def test_an_alias_breaking_a_name_rule_is_refused(aliases: str, words: str) -> None:
    refusal = refusal_of(f"models:\n  - name: qwen3-8b\n    aliases: {aliases}\n    {SIM}\n")
    assert refusal.startswith(words), refusal


def test_post_api_models_reads_aliases_with_the_same_rules() -> None:
    raw, model = parse_model({"name": "m", "aliases": ["gpt-4o"], "profiles": [
        {"engine": "sim"}]})
    assert raw.aliases == ["gpt-4o"] and model.aliases == ("gpt-4o",)
    with pytest.raises(ModelError) as caught:
        parse_model({"name": "m", "aliases": ["a b"], "profiles": [{"engine": "sim"}]})
    assert str(caught.value).startswith("model.aliases[0]: model name 'a b' is not allowed")
    assert caught.value.param == "aliases[0]"


def test_a_model_without_aliases_is_stored_as_before() -> None:
    [raw] = models_of(f"models:\n  - name: m\n    {SIM}\n")
    assert "aliases" not in msgspec.to_builtins(raw)


def test_a_json_body_is_forwarded_naming_the_model_every_other_field_as_written() -> None:
    body = (b'{"messages": [{"role": "user", "content": "h\\u00e9"}], "model": "gpt-4o-mini",'
            b' "stream":true , "n": 1.50}')
    renamed = json_with_model(body, "qwen3-8b")
    assert msgspec.json.decode(renamed) == {**msgspec.json.decode(body), "model": "qwen3-8b"}
    # Fields stay as the client wrote them (escapes, numbers) and in their order.
    assert renamed == (b'{"messages":[{"role": "user", "content": "h\\u00e9"}],'
                       b'"model":"qwen3-8b","stream":true,"n":1.50}')


def test_a_form_body_is_forwarded_naming_the_model_every_other_part_as_written() -> None:
    boundary = "b0undary"
    audio = bytes(range(256)) * 4
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"model\"\r\nContent-Type: audio/wav\r\n\r\n").encode() + audio + (
        f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n"
        f"gpt-4o-mini\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"language\""
        f"\r\n\r\nen\r\n--{boundary}--\r\n").encode()
    content_type = f"multipart/form-data; boundary={boundary}".encode()

    renamed = form_with_model(body, content_type, "qwen3-8b")

    parts = {}
    with multipart.PushMultipartParser(boundary, len(renamed)) as parser:
        name = None
        for event in parser.parse(renamed):
            if isinstance(event, multipart.MultipartSegment):
                name = event.name
                parts[name] = b""
            elif event is not None:
                parts[name] += event
    assert parts == {"file": audio, "model": b"qwen3-8b", "language": b"en"}
    assert renamed == body.replace(b"\r\n\r\ngpt-4o-mini\r\n", b"\r\n\r\nqwen3-8b\r\n")
