"""The emulated kubelet's ConfigMap volumes: laid out as the kubelet's atomic writer lays them out, and brought up
to date the same way when the ConfigMap changes (what an elastic launcher's discover_hosts.sh relies on)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.cluster.kubelet_volumes import stage_files, update_files

ITEMS = [{"key": "discover_hosts.sh", "path": "discover_hosts.sh", "mode": 0o555}]


def test_a_changed_configmap_replaces_the_files_in_one_step_and_an_unchanged_one_touches_nothing(
        tmp_path: Path) -> None:
    folder = stage_files(tmp_path / "mpi", {"discover_hosts.sh": b"echo a\necho b\n"}, ITEMS, 0o644)
    first = (folder / "..data").resolve()
    assert not update_files(folder, {"discover_hosts.sh": b"echo a\necho b\n"}, ITEMS, 0o644)
    assert (folder / "..data").resolve() == first
    assert update_files(folder, {"discover_hosts.sh": b"echo a\n"}, ITEMS, 0o644)
    # The name a reader opens is a link into ..data, which was swapped for a new payload directory; the old
    # one is gone, the new file has the item's mode.
    assert os.readlink(folder / "discover_hosts.sh") == "..data/discover_hosts.sh"
    assert (folder / "discover_hosts.sh").read_bytes() == b"echo a\n"
    assert (folder / "..data").resolve() != first and not first.exists()
    assert ((folder / "..data").resolve() / "discover_hosts.sh").stat().st_mode & 0o777 == 0o555
    assert not (folder / "..data_tmp").exists()


def test_a_key_added_to_the_configmap_appears_beside_the_others(tmp_path: Path) -> None:
    folder = stage_files(tmp_path / "config", {"hostfile": b"a slots=1\n"}, None, 0o644)
    assert update_files(folder, {"hostfile": b"a slots=1\n", "discover_hosts.sh": b"echo a\n"}, None, 0o644)
    assert sorted(path.name for path in folder.iterdir() if not path.name.startswith("..")) == \
        ["discover_hosts.sh", "hostfile"]
    assert (folder / "discover_hosts.sh").read_bytes() == b"echo a\n"
    assert update_files(folder, {"discover_hosts.sh": b"echo a\n"}, None, 0o644)
    assert sorted(path.name for path in folder.iterdir() if not path.name.startswith("..")) == ["discover_hosts.sh"]
