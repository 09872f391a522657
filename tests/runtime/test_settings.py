"""AgentSettings: an agent's options as one object; explicit values beat ``KVLC_*`` variables beat defaults."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvlc.runtime.channel.auth import derive_key
from kvlc.runtime.settings import DEFAULT_TIMEOUT_S, AgentSettings
from kvlc.runtime.staging.buffers import StagingPolicy

pytestmark = pytest.mark.runtime


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for var in ("KVLC_TIMEOUT", "KVLC_LEASE", "KVLC_PROGRESS", "KVLC_SECRET", "KVLC_SECRET_FILE",
                "KVLC_ENGINE_ID", "KVLC_STAGING", "KVLC_INSECURE"):
        monkeypatch.delenv(var, raising=False)


def test_explicit_beats_environment_beats_default(monkeypatch):
    """Each plain field: the default alone, ``KVLC_<FIELD>`` over the default, an explicit value over both."""
    assert AgentSettings().timeout == DEFAULT_TIMEOUT_S and AgentSettings().progress == "thread"
    monkeypatch.setenv("KVLC_TIMEOUT", "5")
    monkeypatch.setenv("KVLC_PROGRESS", "manual")
    monkeypatch.setenv("KVLC_ENGINE_ID", "from-env")
    env = AgentSettings()
    assert (env.timeout, env.progress, env.engine_id) == (5.0, "manual", "from-env")
    mine = AgentSettings(timeout=7, progress="nixl", engine_id="mine")
    assert (mine.timeout, mine.progress, mine.engine_id) == (7.0, "nixl", "mine")


def test_secret_is_hidden_and_keys_the_channel(monkeypatch, tmp_path):
    """The secret is a SecretStr (never printed); secret= beats $KVLC_SECRET; a secret file is read."""
    monkeypatch.setenv("KVLC_SECRET", "env-secret-0123456789")
    s = AgentSettings()
    assert "env-secret" not in repr(s) and s.channel_key() == derive_key(b"env-secret-0123456789")
    assert AgentSettings(secret="given-secret-0123456789").channel_key() == derive_key(b"given-secret-0123456789")
    monkeypatch.delenv("KVLC_SECRET")
    f = tmp_path / "key"
    f.write_text("file-secret-0123456789\n")
    monkeypatch.setenv("KVLC_SECRET_FILE", str(f))
    assert AgentSettings().channel_key() == derive_key(b"file-secret-0123456789")


def test_objects_are_given_not_read_from_text(monkeypatch):
    """``KVLC_STAGING`` stays the staging policy's variable: read by StagingPolicy.from_env when no
    policy is given, and an explicit policy wins over it."""
    monkeypatch.setenv("KVLC_STAGING", "always")
    assert AgentSettings().staging is None and AgentSettings().staging_policy().mode == "always"
    assert AgentSettings(staging=StagingPolicy.never()).staging_policy().mode == "never"


def test_unknown_options_are_refused():
    """A misspelt option is an error, not silently ignored."""
    with pytest.raises(ValidationError, match="timout"):
        AgentSettings(timout=3)
