"""Kubernetes quantities and names in a cluster platform block are checked when the block is made, as the
API server would check them when a stage sends them (issue 19, item 8)."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
from pydantic import ValidationError

from tasks.k8s.quantity import InvalidQuantity, parse_quantity, validate_size
from tasks.platforms import ClusterPlatform
from tests.cluster.quantities import quantity_value


def api_server_value(text: str) -> Decimal | None:
    """The API server's own reading (the emulator's reimplementation of apimachinery, not laneflow's)."""
    return quantity_value(text)[0]


@pytest.mark.parametrize("text", ["100Gi", "8Gi", "64Ki", "1.5Gi", "500M", "1e3", "2E6", "0.5", ".5", "5.", "+1k",
                                  "-1", "250m", "3n", "7u", "1E", "8GB", "8 Gi", "Bogus_Value!", "1.2.3Gi", "Gi",
                                  "", "8gi", "8KI", "1e", "1ee3", "0x10", "8Gu"])
def test_quantities_are_accepted_and_valued_as_the_api_server_does(text: str) -> None:
    expected = api_server_value(text)
    if expected is None:
        with pytest.raises(InvalidQuantity, match="is not a Kubernetes quantity"):
            parse_quantity(text)
    else:
        assert parse_quantity(text) == expected


def test_sizes_must_be_whole_positive_byte_counts() -> None:
    assert validate_size("100Gi", "volume_size") == "100Gi"
    for text, why in (("0", "more than 0"), ("-1Gi", "more than 0"), ("0.5", "fraction of a byte")):
        with pytest.raises(InvalidQuantity, match=why):
            validate_size(text, "volume_size")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("shm_size", "8GB", "shm_size '8GB' is not a Kubernetes quantity"),
    ("volume_size", "100 Gi", "volume_size '100 Gi' is not a Kubernetes quantity"),
    ("namespace", "Lanes", "namespace name 'Lanes' is not a DNS-1123 label"),
    ("storage_class", "azure_netapp", "storage_class 'azure_netapp' is not a DNS-1123 subdomain"),
    ("snapshot_class", "", "snapshot_class must be a non-empty string"),
    ("service_account", "Training", "service_account 'Training' is not a DNS-1123 subdomain"),
    ("runai_project", "p" * 60, "has 66 characters; at most 63"),
])
def test_a_cluster_platform_block_with_a_typo_is_refused_when_it_is_made(field: str, value: str,
                                                                         message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        ClusterPlatform(**{field: value})
    assert ClusterPlatform(shm_size="64Mi", volume_size="1.5Ti", storage_class="azure-netapp-files").shm_size == "64Mi"
