"""A Redis Cluster by URL (issue 36): the settings accept redis+cluster:// (password masked in
their errors), the store config then uses hash-tagged names; status names the trainer lease's holder."""

from __future__ import annotations

import pytest

from daemon.settings import ConfigError, Settings, load_settings, store_config


def test_a_cluster_url_turns_hash_tags_on(monkeypatch):
    monkeypatch.setenv("DRAFTD_REDIS__URL", "redis+cluster://:s3cret@10.0.0.1:7000,10.0.0.2:7000")
    s = load_settings(None)
    cfg = store_config(s)
    assert cfg.hash_tags is True and cfg.keys.stream == "draftd:{samples}"
    assert "s3cret" not in repr(s.redis)
    monkeypatch.delenv("DRAFTD_REDIS__URL")
    assert store_config(Settings()).hash_tags is None  # single node: decided by the client (plain names)


def test_a_url_without_a_known_scheme_names_the_cluster_form(monkeypatch):
    monkeypatch.setenv("DRAFTD_REDIS__URL", "cluster://:s3cret@h:1")
    with pytest.raises(ConfigError, match=r"redis\+cluster://") as e:
        load_settings(None)
    assert "s3cret" not in str(e.value)


def test_status_names_the_trainer_lease_holder(redis_client, key_prefix):
    from daemon.reports import lease_section
    from store.config import StoreConfig
    from store.lease import Lease

    cfg = StoreConfig(key_prefix=key_prefix)
    assert lease_section(redis_client, cfg) is None
    lease = Lease(redis_client, cfg, "trainer-host-1", ttl_s=10)
    token = lease.try_acquire()
    st = lease_section(redis_client, cfg)
    assert st["holder"] == "trainer-host-1" and st["token"] == token and 0 < st["expires_in_s"] <= 10
    lease.release()
