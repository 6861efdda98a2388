"""The serve config's keys are declared once (default, description, bounds): the loader's messages and
docs/configuration.md both come from those declarations."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from duospec.coordinator import config as c
from duospec.coordinator.config_reference import config_reference
from duospec.draft_worker.proposer import DraftSpec, NgramOptions
from duospec.settings import declaration

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_docs_are_the_generated_reference():
    assert DOCS.read_text(encoding="utf-8") == config_reference(), \
        "docs/configuration.md is stale: run `duospec config-reference > docs/configuration.md`"


@pytest.mark.parametrize("cls", [c.ServeConfig, c.ServerSettings, c.TlsSettings, c.InternalTlsSettings,
                                 c.ModelConfig, c.SpeculationDefaults, DraftSpec, NgramOptions])
def test_every_key_is_declared_and_in_the_reference(cls):
    reference = config_reference()
    for f in dataclasses.fields(cls):
        if cls is DraftSpec and f.name == "ngram":  # its keys are NgramOptions'
            continue
        assert "setting" in f.metadata, f"{cls.__name__}.{f.name}: declare it with setting()"
        headings = [line.rsplit(".", 1)[-1].removeprefix("## ").removesuffix("[]")
                    for line in reference.splitlines() if line.startswith("## ")]
        as_section = f.name in headings  # `## server`, `## models[]`, `## models[].speculation`, ...
        assert f"| `{f.name}` |" in reference or as_section, f.name
        assert f.metadata["setting"].description[1:] in reference  # a section's is capitalised


@pytest.mark.parametrize("cls, section, key, value", [
    (c.ModelConfig, "models[0]", "max_batch_size", 5000),
    (c.ServerSettings, "server", "send_timeout_s", 0.5),
    (c.SpeculationDefaults, "models[0].speculation", "hedges", 17),
    (NgramOptions, "models[0].draft", "max_proposal", 0),
])
def test_a_bound_broken_in_a_yaml_file_is_named_with_the_declared_bounds(tmp_path, cls, section, key, value):
    _, declared = declaration(cls, key)
    model = {"name": "m", "target": "t", "draft": "d"}
    if section == "server":
        raw = {"server": {key: value}, "models": [model]}
    elif section.endswith("speculation"):
        raw = {"models": [{**model, "speculation": {key: value}}]}
    elif section.endswith("draft"):
        raw = {"models": [{**model, "draft": {"method": "ngram", key: value}}]}
    else:
        raw = {"models": [{**model, key: value}]}
    import yaml

    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(raw))
    kind = "an integer" if isinstance(value, int) else "a number"
    with pytest.raises(c.ConfigError) as info:
        c.load_serve_config(path)
    assert str(info.value) == (f"{path}: {section}.{key}: {value} is out of range; use {kind} in "
                               f"[{declared.lo}, {declared.hi}]")


def test_a_default_left_out_of_the_file_is_the_declared_one():
    config = c.parse_serve_config({"models": [{"name": "m", "target": "t", "draft": {"method": "ngram"}}]})
    model = config.models[0]
    for cls, obj in [(c.ServerSettings, config.server), (c.ModelConfig, model), (NgramOptions, model.draft.ngram)]:
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING and f.name != "draft":
                assert getattr(obj, f.name) == f.default, f"{cls.__name__}.{f.name}"


def test_the_command_prints_the_reference(capsys):
    from duospec.cli import main

    assert main(["config-reference"]) == 0
    assert capsys.readouterr().out == config_reference()
