"""deploy/examples/smollm2.yaml: `duospec serve --config deploy/examples/smollm2.yaml` serves what
`duospec pull smollm2` installed, wherever the user's home is, with the drafter `make demo` uses."""

from __future__ import annotations

import pathlib

import pytest

from duospec.coordinator.config import load_serve_config
from duospec.draft_worker.proposer import DraftMethod
from duospec.pull import PULLABLE, model_dir

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "examples" / "smollm2.yaml"


@pytest.fixture
def home(tmp_path, monkeypatch) -> pathlib.Path:
    """A user whose home is tmp_path and who has not moved duospec's cache."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("DUOSPEC_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return tmp_path


def test_the_example_serves_the_pulled_target_from_the_users_home(home):
    config = load_serve_config(EXAMPLE)
    [model] = config.models
    assert model.name in PULLABLE, "the demo pulls the model by its name"
    expected = home / ".cache" / "duospec" / "models" / PULLABLE[model.name].dir_name
    assert model.target == str(model_dir(model.name)) == str(expected), "`~` is the user's home, as the pull's"
    assert pathlib.Path(config.ledger).is_relative_to(home), "the usage ledger stays out of the repository"


def test_the_example_names_one_drafter_the_draft_shipped_for_its_target(home):
    """From any working directory: the draft's relative path is read from the config's folder."""
    import json

    [model] = load_serve_config(EXAMPLE).models
    assert model.draft is not None and model.draft.method is DraftMethod.MODEL
    assert pathlib.Path(model.draft.path) == REPO / "models" / "smollm2" / "draft"
    config = json.loads((pathlib.Path(model.draft.path) / "config.json").read_text())
    assert config["vocab_size"] == 49152, "a draft with SmolLM2's vocabulary"
    assert model.speculation.mode.value == "pearl"
    assert sum(line.lstrip().startswith("draft:") for line in EXAMPLE.read_text().splitlines()) == 1


def test_the_documented_command_gives_the_same_config(home, monkeypatch):
    from duospec.cli import build_parser
    from duospec.cli.serve import build_config

    monkeypatch.chdir(REPO)
    args = build_parser().parse_args(["serve", "--config", "deploy/examples/smollm2.yaml"])
    config = build_config(args)
    assert config.models == load_serve_config(EXAMPLE).models
    assert (config.server.host, config.server.port, config.server.http_port) == ("127.0.0.1", 50051, 8000)
