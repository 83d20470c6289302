"""laneflow's old images are removed, and only they (scripts/image_gc.py): every change of the sources used to
leave a GB image behind until CI ran out of disk in the middle of a build. What stays: the flavour tags'
images, what a user tagged, what a running process uses, and whatever those were built on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from scripts import image_gc, images
from scripts.image_gc import Container, StoredImage, plan_containers, plan_removal
from tests.conftest import PROJECT_ROOT

BASE = "b" * 64


def image(name: str, parent: str | None, *names: str) -> StoredImage:
    return StoredImage(name * 64 if len(name) == 1 else name, tuple(names), parent)


def test_stale_builds_go_with_their_own_build_cache_but_not_with_what_a_kept_image_was_built_on() -> None:
    # base <- shared <- old_step <- old (a stale content key); base <- shared <- new (the :cpu image)
    shared = image("s", BASE)
    old_step, old = image("o", shared.id), image("p", "o" * 64, "localhost/laneflow-train:0123456789abcdef")
    new = image("n", shared.id, "localhost/laneflow-train:cpu", "localhost/laneflow-train:fedcba9876543210")
    derived = image("d", old.id, "localhost/laneflow-train:strict-modes")  # a test's, built on the old one
    stored = [StoredImage(BASE, ("localhost/laneflow-base:bookworm",)), shared, old_step, old, new, derived]
    stale = plan_removal(stored, base_id=BASE, keep_names={"localhost/laneflow-train:cpu"}, pinned=set())
    assert stale == [derived.id, old.id, old_step.id]  # children first; base and shared stay
    # The derived image in use by a test session keeps what it was built on.
    assert plan_removal(stored, base_id=BASE, keep_names={"localhost/laneflow-train:cpu"}, pinned={derived.id}) == []


def test_what_a_user_tagged_and_what_is_not_built_on_laneflows_base_stay() -> None:
    pushed = image("u", BASE, "localhost/laneflow-train:0123456789abcdef", "registry.example.org/laneflow:0.1.0")
    foreign_base = image("f", None, "docker.io/library/debian:bookworm")
    foreign = image("g", foreign_base.id, "localhost/laneflow-train:something")  # ours by name, not by base
    dangling = image("x", foreign_base.id)
    stored = [StoredImage(BASE), pushed, foreign_base, foreign, dangling]
    assert plan_removal(stored, base_id=BASE, keep_names=set(), pinned=set()) == []


def test_only_laneflows_leftover_build_containers_and_stale_root_file_systems_are_removed() -> None:
    ours, stale, theirs = "1" * 64, "2" * 64, "3" * 64
    containers = [
        Container("laneflow-rootfs-111111111111", ours),          # a kept image's: stays
        Container("laneflow-rootfs-222222222222", stale),          # a stale image's: goes
        Container(f"{ours[:12]}-working-container-3", ours),       # a failed build of ours left it: goes
        Container("laneflow-base-working-container", ours),        # the same, from a Dockerfile's FROM
        Container(f"{theirs[:12]}-working-container", theirs),     # someone else's build: stays, pins
        Container("my-experiment", ours),                          # a user's container: stays, pins
    ]
    removable, pinned = plan_containers(containers, ours={ours, stale}, stale={stale},
                                        rootfs_prefix="laneflow-rootfs-")
    assert removable == ["laneflow-rootfs-222222222222", f"{ours[:12]}-working-container-3",
                         "laneflow-base-working-container"]
    assert pinned == {theirs, ours}


def hold_in_a_child(folder: Path, image_id: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys; from pathlib import Path; from scripts.image_gc import InUse\n"
        f"in_use = InUse(Path({str(folder)!r})); in_use.hold({image_id!r}); print('held', flush=True); "
        "sys.stdin.read()")],
        cwd=PROJECT_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert child.stdout.readline().strip() == "held"
    return child


def stop(child: subprocess.Popen) -> None:
    child.stdin.close()
    try:
        child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def test_an_image_another_process_uses_is_held_until_that_process_ends(tmp_path: Path) -> None:
    in_use = image_gc.InUse(tmp_path)
    child = hold_in_a_child(tmp_path, "a" * 64)
    try:
        assert in_use.used() == {"a" * 64}
    finally:
        stop(child)
    assert in_use.used() == set() and not (tmp_path / ("a" * 64)).exists()  # the kernel dropped the lock
    in_use.hold("c" * 64)
    assert in_use.used() == {"c" * 64}  # this process's own holds count too


def buildah(*argv: str) -> str:
    return subprocess.run(["buildah", *argv], check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.slow
def test_collect_removes_a_stale_build_once_nothing_uses_it_and_keeps_the_rest(tmp_path: Path) -> None:
    """For real, on buildah's store: images built on a base of this test's own (so that nothing of the suite's
    is touched), one of them in use by another process."""
    if missing := images.missing_tools():
        pytest.skip(missing)
    run = uuid.uuid4().hex[:8]
    repository = f"localhost/laneflow-gctest-{run}"
    scratch = buildah("from", "scratch")
    buildah("commit", "--rm", scratch, f"{repository}:base")
    base = images.image_id(f"{repository}:base")
    context = tmp_path / "context"
    context.mkdir()

    def build(name: str, parent: str, tag: str) -> str:
        (context / name).write_text(f"{name} {run}\n")
        (tmp_path / f"Dockerfile.{name}").write_text(f"FROM {parent}\nCOPY {name} /{name}\n")
        return images.build_dockerfile(tmp_path / f"Dockerfile.{name}", tag, context=context, base_id=parent)

    kept = build("kept", base, f"{repository}:cpu")
    stale = build("stale", base, f"{repository}:old")  # also tagged with its content key, as every build is
    derived = build("derived", stale, f"{repository}:derived")
    pushed = build("pushed", base, f"{repository}:pushed")
    buildah("tag", pushed, f"registry.example.org/gctest-{run}:0.1.0")
    buildah("from", "--pull=never", "--name", f"gctest-rootfs-{stale[:12]}", stale)
    buildah("from", "--pull=never", "--name", f"{stale[:12]}-working-container", stale)  # a failed build's
    in_use = image_gc.InUse(tmp_path / "in-use")
    child = hold_in_a_child(tmp_path / "in-use", derived)
    try:
        said: list[str] = []
        first = image_gc.collect(base_id=base, keep_names={f"{repository}:cpu"}, in_use=in_use,
                                 rootfs_prefix="gctest-rootfs-", log=said.append)
        assert (first.images, first.containers) == (0, 1)  # only the failed build's container
        assert all(images.image_id(i) for i in (kept, stale, derived, pushed))
        stop(child)
        second = image_gc.collect(base_id=base, keep_names={f"{repository}:cpu"}, in_use=in_use,
                                  rootfs_prefix="gctest-rootfs-", log=said.append)
        assert (second.images, second.containers) == (2, 1)
        assert images.image_id(derived) is None and images.image_id(stale) is None
        assert images.image_id(f"{repository}:old") is None
        assert images.image_id(kept) and images.image_id(pushed) and images.image_id(base)
        names = {c["containername"] for c in image_gc.list_containers()}
        assert not {f"gctest-rootfs-{stale[:12]}", f"{stale[:12]}-working-container"} & names
        assert said[-1].startswith("images: removed 2 stale images and 1 containers")
    finally:
        stop(child)
        subprocess.run(["buildah", "rmi", "--force", kept, pushed, base, derived, stale], capture_output=True)


@pytest.mark.slow
def test_listing_the_store_while_another_process_adds_and_removes_containers_never_fails(tmp_path: Path) -> None:
    """``buildah containers`` reads each container's directory after the list, so a container removed in between
    failed it with "container not known" (a CI run's collect did, while other tests built images). The
    listing is asked again; here a child adds and removes containers of a scratch image the whole time."""
    if missing := images.missing_tools():
        pytest.skip(missing)
    scratch = buildah("from", "scratch")
    tag = f"localhost/laneflow-gctest-{uuid.uuid4().hex[:8]}:churn"
    buildah("commit", "--rm", scratch, tag)
    churn = subprocess.Popen(["bash", "-c", f"while true; do buildah rm \"$(buildah from --pull=never {tag})\"; done"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        listings = [image_gc.list_containers() for _ in range(30)]
        assert churn.poll() is None  # it churned the whole time
        assert any(c["imagename"] == tag for listed in listings for c in listed)  # it saw the churn
    finally:
        os.killpg(churn.pid, signal.SIGKILL)
        churn.wait()
        for listed in image_gc.list_containers():
            if listed["imagename"] == tag:
                subprocess.run(["buildah", "rm", listed["containername"]], capture_output=True)
        subprocess.run(["buildah", "rmi", "--force", tag], capture_output=True)
