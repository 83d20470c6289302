"""A kubeconfig stored in a platform block is readable by anyone who can read blocks: one with a credential in
clear gets a warning each time a run loads the block, naming what is exposed (never its value)."""

from __future__ import annotations

import logging

import pytest
from prefect_kubernetes.credentials import KubernetesClusterConfig, KubernetesCredentials

from tasks.platforms import ClusterPlatform, load_platform
from tasks.platforms.cluster.kubeconfig import credentials_in_clear

TOKEN = "t0ken-value-9f3a"


def kubeconfig(user: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Config", "current-context": "aks",
            "clusters": [{"name": "aks", "cluster": {"server": "https://aks.example.org:443"}}],
            "contexts": [{"name": "aks", "context": {"cluster": "aks", "user": "me"}}],
            "users": [{"name": "me", "user": user}]}


@pytest.mark.parametrize(("user", "found"), [
    ({"token": TOKEN}, ["me.token"]),
    ({"client-certificate-data": "Y2VydA==", "client-key-data": "a2V5"}, ["me.client-key-data"]),
    ({"username": "admin", "password": "pw"}, ["me.password"]),
    ({"auth-provider": {"name": "azure", "config": {"access-token": "x"}}}, ["me.auth-provider"]),
    ({"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": "kubelogin"}}, []),
    ({"client-certificate": "/etc/k/cert", "client-key": "/etc/k/key"}, []),  # files, not keys
])
def test_the_credentials_a_stored_kubeconfig_holds_in_clear(user: dict, found: list[str]) -> None:
    assert credentials_in_clear(kubeconfig(user)) == found


def test_loading_a_block_with_a_token_in_clear_warns_without_the_token(
        prefect_server: dict, caplog: pytest.LogCaptureFixture) -> None:
    credentials = KubernetesCredentials(cluster_config=KubernetesClusterConfig(config=kubeconfig({"token": TOKEN}),
                                                                               context_name="aks"))
    ClusterPlatform(credentials=credentials, image="i:1", data_image="d:1").save("kubeconfig-in-clear",
                                                                                 overwrite=True)
    ClusterPlatform(credentials=None, image="i:1", data_image="d:1").save("in-cluster", overwrite=True)
    with caplog.at_level(logging.WARNING, logger="laneflow"):
        load_platform("kubeconfig-in-clear")
        load_platform("in-cluster")
    warnings = [record.getMessage() for record in caplog.records if record.name == "laneflow"]
    assert len(warnings) == 1, warnings
    assert "platform block 'kubeconfig-in-clear' stores a kubeconfig with credentials in clear (me.token)" in \
        warnings[0] and "leave the block's credentials empty" in warnings[0] and TOKEN not in warnings[0]
