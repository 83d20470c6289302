"""Tests for training.data.archive with real zip/tar archives built in tmp_path (no mocks).

Nothing may appear outside the target, and a refused archive leaves no staging folder behind.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from training.data import archive as archive_mod
from training.data.archive import MARKER, ArchiveEntry, UnsafeArchiveError, check_entry, extract, read_marker

# --------------------------------------------------------------------------------------------------
# helpers: build real archives
# --------------------------------------------------------------------------------------------------


def _file(name: str, data: bytes | str) -> tuple:
    return ("file", name, data.encode() if isinstance(data, str) else data)


def _dir(name: str) -> tuple:
    return ("dir", name, None)


def _sym(name: str, target: str) -> tuple:
    return ("symlink", name, target)


def _hard(name: str, target: str) -> tuple:
    return ("hardlink", name, target)


def _special(name: str, tar_type: bytes) -> tuple:
    return ("special", name, tar_type)


def make_tar(path: Path, entries: list[tuple], mode: str = "w") -> Path:
    with tarfile.open(path, mode) as tf:
        for kind, name, payload in entries:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if kind == "file":
                info.size = len(payload)
                info.mode = 0o644
                tf.addfile(info, io.BytesIO(payload))
                continue
            if kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, payload
            elif kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, payload
            elif kind == "special":
                info.type, info.devmajor, info.devminor = payload, 1, 3
            tf.addfile(info)
    return path


def make_zip(path: Path, entries: list[tuple]) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for kind, name, payload in entries:
            if kind == "file":
                zf.writestr(name, payload)
            elif kind == "dir":
                zf.writestr(zipfile.ZipInfo(name.rstrip("/") + "/"), b"")
            elif kind == "symlink":
                info = zipfile.ZipInfo(name)
                info.create_system = 3  # unix
                info.external_attr = 0o120777 << 16
                zf.writestr(info, payload)
            else:  # pragma: no cover - helper misuse
                raise AssertionError(kind)
    return path


def tar_names(path: Path) -> list[str]:
    with tarfile.open(path) as tf:
        return tf.getnames()


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(root: Path) -> set[str]:
    """Every path below ``root`` (links not followed), relative, as strings."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            found.add(os.path.relpath(os.path.join(dirpath, name), root))
    return found


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """Folder for the archives, separate from the extraction target."""
    folder = tmp_path / "src"
    folder.mkdir()
    return folder


@pytest.fixture
def target(tmp_path: Path) -> Path:
    return tmp_path / "target"


def staging_of(target: Path) -> Path:
    return target.with_name(f".{target.name}.extracting")


def assert_refused_and_clean(archive: Path, target: Path, tmp_path: Path, match: str | None = None) -> None:
    """extract() raises UnsafeArchiveError and leaves tmp_path exactly as it was."""
    before = snapshot(tmp_path)
    with pytest.raises(UnsafeArchiveError, match=match):
        extract(archive, target, sha256_of(archive))
    assert snapshot(tmp_path) == before
    assert not target.exists()
    assert not staging_of(target).exists()


# --------------------------------------------------------------------------------------------------
# zip-slip and absolute paths
# --------------------------------------------------------------------------------------------------


def test_zip_slip_is_refused_and_nothing_is_written_outside(tmp_path: Path, src: Path, target: Path) -> None:
    archive = make_zip(src / "slip.zip", [_file("good/ok.txt", "fine"), _file("../evil.txt", "pwned")])
    before = snapshot(tmp_path)

    with pytest.raises(UnsafeArchiveError, match=r"\.\./evil\.txt"):
        extract(archive, target, sha256_of(archive))

    assert snapshot(tmp_path) == before == {"src", "src/slip.zip"}
    assert not any(p.name == "evil.txt" for p in tmp_path.rglob("*"))
    assert not (tmp_path.parent / "evil.txt").exists()
    assert not staging_of(target).exists()
    assert not (tmp_path / ".target.extracting").exists()
    assert not target.exists()


def test_tar_slip_after_a_good_entry_leaves_nothing(tmp_path: Path, src: Path, target: Path) -> None:
    # tar is streamed, so the good entry is already in the staging folder when '../evil.txt' arrives.
    archive = make_tar(src / "slip.tar.gz", [_file("good/ok.txt", "fine"), _file("../evil.txt", "pwned")], "w:gz")
    assert_refused_and_clean(archive, target, tmp_path)
    assert not any(p.name == "evil.txt" for p in tmp_path.rglob("*"))
    assert not (tmp_path.parent / "evil.txt").exists()


def test_tar_absolute_path_is_refused(tmp_path: Path, src: Path, target: Path) -> None:
    archive = make_tar(src / "abs.tar", [_file("ok.txt", "x"), _file("/tmp/abs.txt", "abs")])
    assert tar_names(archive) == ["ok.txt", "/tmp/abs.txt"]  # really absolute in the archive
    assert_refused_and_clean(archive, target, tmp_path, match="absolute")


def test_zip_absolute_path_is_refused(tmp_path: Path, src: Path, target: Path) -> None:
    archive = make_zip(src / "abs.zip", [_file("ok.txt", "x"), _file("/tmp/abs.txt", "abs")])
    with zipfile.ZipFile(archive) as zf:
        assert zf.namelist() == ["ok.txt", "/tmp/abs.txt"]
    assert_refused_and_clean(archive, target, tmp_path, match="absolute")


# --------------------------------------------------------------------------------------------------
# links
# --------------------------------------------------------------------------------------------------


def test_tar_symlink_escaping_target_is_refused(tmp_path: Path, src: Path, target: Path) -> None:
    archive = make_tar(src / "sym.tar", [_file("a.txt", "a"), _sym("link", "../../outside")])
    assert_refused_and_clean(archive, target, tmp_path, match="points outside")


def test_tar_nested_symlink_escaping_target_is_refused(tmp_path: Path, src: Path, target: Path) -> None:
    archive = make_tar(src / "sym.tar", [_dir("a/b"), _sym("a/b/link", "../../../x")])
    assert_refused_and_clean(archive, target, tmp_path, match="points outside")


def test_tar_absolute_symlink_is_refused(tmp_path: Path, src: Path, target: Path) -> None:
    archive = make_tar(src / "sym.tar", [_sym("link", "/etc/passwd")])
    assert_refused_and_clean(archive, target, tmp_path, match="points outside")


def test_zip_symlink_escaping_target_is_refused(tmp_path: Path, src: Path, target: Path) -> None:
    archive = make_zip(src / "sym.zip", [_file("a.txt", "a"), _sym("link", "../x")])
    with zipfile.ZipFile(archive) as zf:
        info = zf.getinfo("link")
    assert stat.S_ISLNK(info.external_attr >> 16)
    assert_refused_and_clean(archive, target, tmp_path, match="points outside")


def test_tar_hardlink_escaping_target_is_refused(tmp_path: Path, src: Path, target: Path) -> None:
    (tmp_path / "x").write_text("outside")
    archive = make_tar(src / "hard.tar", [_file("a.txt", "a"), _hard("h", "../x")])
    assert_refused_and_clean(archive, target, tmp_path, match="points outside")
    assert (tmp_path / "x").stat().st_nlink == 1


def test_tar_hardlink_to_a_symlink_is_refused(tmp_path: Path, src: Path, target: Path) -> None:
    archive = make_tar(src / "hard.tar", [_file("b.txt", "b"), _sym("s", "b.txt"), _hard("h", "s")])
    assert_refused_and_clean(archive, target, tmp_path, match="no file to link to")


def test_tar_hardlink_inside_target_is_extracted(src: Path, target: Path) -> None:
    archive = make_tar(src / "hard.tar", [_file("dir/b.txt", "bee"), _hard("h", "dir/b.txt")])
    assert extract(archive, target, sha256_of(archive)) is True
    assert (target / "h").read_text() == "bee"
    assert os.path.samefile(target / "h", target / "dir" / "b.txt")


def test_tar_symlink_to_dot_alone_is_fine(src: Path, target: Path) -> None:
    archive = make_tar(src / "dot.tar", [_file("a.txt", "a"), _sym("d", ".")])
    assert extract(archive, target, sha256_of(archive)) is True
    assert (target / "d").is_symlink()
    assert os.readlink(target / "d") == "."


def test_tar_symlink_to_parent_is_refused(tmp_path: Path, src: Path, target: Path) -> None:
    archive = make_tar(src / "up.tar", [_file("a.txt", "a"), _sym("d", ".."), _file("d/evil.txt", "pwned")])
    assert_refused_and_clean(archive, target, tmp_path, match="points outside")
    assert not (tmp_path / "evil.txt").exists()


@pytest.mark.parametrize("link_target", [".", "sub"])
def test_tar_entry_written_through_an_inner_symlink_is_refused(
    tmp_path: Path, src: Path, target: Path, link_target: str
) -> None:
    # The link itself stays inside, but writing *through* it is refused all the same.
    archive = make_tar(src / "through.tar", [_dir("sub"), _sym("d", link_target), _file("d/x.txt", "via link")])
    assert_refused_and_clean(archive, target, tmp_path, match="through the link")


def test_zip_entry_written_through_an_inner_symlink_is_refused(tmp_path: Path, src: Path, target: Path) -> None:
    archive = make_zip(src / "through.zip", [_sym("d", "."), _file("d/x.txt", "via link")])
    assert_refused_and_clean(archive, target, tmp_path, match="through the link")


def test_safe_relative_symlink_is_extracted_as_symlink(src: Path, target: Path) -> None:
    archive = make_tar(src / "ok.tar", [_file("b.txt", "bee"), _dir("a"), _sym("a/link", "../b.txt")])
    assert extract(archive, target, sha256_of(archive)) is True
    link = target / "a" / "link"
    assert link.is_symlink()
    assert os.readlink(link) == "../b.txt"
    assert link.read_text() == "bee"
    assert link.resolve() == (target / "b.txt").resolve()


def test_zip_safe_relative_symlink_is_extracted_as_symlink(src: Path, target: Path) -> None:
    archive = make_zip(src / "ok.zip", [_file("b.txt", "bee"), _sym("a/link", "../b.txt")])
    assert extract(archive, target, sha256_of(archive)) is True
    link = target / "a" / "link"
    assert link.is_symlink()
    assert os.readlink(link) == "../b.txt"
    assert link.read_text() == "bee"


def test_symlink_chain_escaping_target_is_refused(src: Path, target: Path) -> None:
    archive = make_tar(src / "chain.tar", [_dir("sub"), _sym("sub/l", ".."), _sym("sub/l2", "l/..")])
    try:
        extract(archive, target, sha256_of(archive))
    except UnsafeArchiveError:
        return
    escaped = Path(os.path.realpath(target / "sub" / "l2"))
    raise AssertionError(f"extracted a symlink that resolves outside the target: sub/l2 -> {escaped}")


def test_hardlink_through_symlink_chain_cannot_reach_outside_file(tmp_path: Path, src: Path, target: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("outside the target")
    archive = make_tar(
        src / "chain.tar",
        [_dir("sub"), _sym("sub/l", ".."), _sym("sub/l2", "l/.."), _hard("h", "sub/l2/secret.txt")],
    )
    try:
        extract(archive, target, sha256_of(archive))
    except UnsafeArchiveError:
        assert secret.stat().st_nlink == 1
        return
    linked = (target / "h").exists() and os.path.samefile(target / "h", secret)
    raise AssertionError(f"archive accepted; target/h is the outside file: {linked}, nlink={secret.stat().st_nlink}")


# --------------------------------------------------------------------------------------------------
# devices and fifos
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tar_type", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE], ids=["chardev", "blockdev", "fifo"]
)
def test_tar_device_and_fifo_entries_are_refused(tmp_path: Path, src: Path, target: Path, tar_type: bytes) -> None:
    archive = make_tar(src / "dev.tar", [_file("a.txt", "a"), _special("dev/thing", tar_type)])
    assert_refused_and_clean(archive, target, tmp_path, match="only files, folders and links")


# --------------------------------------------------------------------------------------------------
# correct extraction
# --------------------------------------------------------------------------------------------------


def _payload() -> dict[str, bytes]:
    big = os.urandom(2 * archive_mod.CHUNK_BYTES + 12_345)  # > 1 MiB, not a multiple of the chunk size
    assert len(big) > (1 << 20)
    return {
        "top.txt": b"top level\n",
        "a/b/c/deep.bin": bytes(range(256)) * 3,
        "a/b/sibling.txt": b"sibling",
        "a/empty.txt": b"",
        "big/blob.bin": big,
    }


@pytest.mark.parametrize("kind", ["tar.gz", "tar", "zip"])
def test_nested_archive_extracts_identical_bytes(tmp_path: Path, src: Path, target: Path, kind: str) -> None:
    files = _payload()
    entries = [_dir("a"), _dir("a/b"), _dir("a/b/c"), _dir("empty_dir")]
    entries += [_file(name, data) for name, data in files.items()]
    if kind == "zip":
        archive = make_zip(src / "data.zip", entries)
    else:
        archive = make_tar(src / f"data.{kind}", entries, "w:gz" if kind == "tar.gz" else "w")

    assert extract(archive, target, sha256_of(archive)) is True

    for name, data in files.items():
        assert (target / name).read_bytes() == data, name
    assert (target / "empty_dir").is_dir()
    extracted = {str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()}
    assert extracted == set(files) | {MARKER}
    marker = read_marker(target)
    assert marker == {"archive": archive.name, "archive_sha256": sha256_of(archive), "entries": len(entries)}
    assert not staging_of(target).exists()
    assert snapshot(tmp_path) - {f"target/{p}" for p in snapshot(target)} == {"src", f"src/{archive.name}", "target"}


def test_dot_slash_prefixed_entries_are_normalised(src: Path, target: Path) -> None:
    archive = make_tar(src / "dot.tar.gz", [_dir("./a"), _file("./a/f.txt", "hi")], "w:gz")
    assert extract(archive, target, sha256_of(archive)) is True
    assert (target / "a" / "f.txt").read_text() == "hi"


def test_tar_of_dot_directory_is_extracted(tmp_path: Path, src: Path, target: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "a").mkdir(parents=True)
    (tree / "a" / "f.txt").write_text("hi")
    archive = src / "dot.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(tree, arcname=".")
    assert tar_names(archive)[0] == "."
    assert extract(archive, target, sha256_of(archive)) is True
    assert (target / "a" / "f.txt").read_text() == "hi"


def test_plain_tar_ending_with_a_zip_member_is_extracted_as_tar(src: Path, target: Path) -> None:
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as zf:
        zf.writestr("inner.txt", "inner")
    archive = make_tar(src / "data.tar", [_file("real.txt", "real"), _file("nested.zip", inner.getvalue())])
    assert extract(archive, target, sha256_of(archive)) is True
    extracted = sorted(p.name for p in target.iterdir())
    assert extracted == sorted([MARKER, "real.txt", "nested.zip"]), f"extracted the wrong archive: {extracted}"
    assert (target / "nested.zip").read_bytes() == inner.getvalue()


# --------------------------------------------------------------------------------------------------
# idempotence
# --------------------------------------------------------------------------------------------------


def test_same_sha256_is_extracted_once(src: Path, target: Path) -> None:
    archive = make_zip(src / "v1.zip", [_file("a/one.txt", "1")])
    sha = sha256_of(archive)

    assert extract(archive, target, sha) is True
    assert (target / MARKER).is_file()
    assert read_marker(target)["archive_sha256"] == sha

    sentinel = target / "added-after.txt"
    sentinel.write_text("untouched")
    assert extract(archive, target, sha) is False
    assert sentinel.read_text() == "untouched"  # skipped, not re-extracted
    assert (target / "a" / "one.txt").read_text() == "1"


def test_different_sha256_re_extracts_and_replaces_old_content(src: Path, target: Path) -> None:
    old = make_tar(src / "v1.tar.gz", [_file("common.txt", "old"), _file("only_old/gone.txt", "bye")], "w:gz")
    new = make_tar(src / "v2.tar.gz", [_file("common.txt", "new"), _file("only_new.txt", "hello")], "w:gz")
    assert sha256_of(old) != sha256_of(new)

    assert extract(old, target, sha256_of(old)) is True
    assert (target / "only_old" / "gone.txt").exists()

    assert extract(new, target, sha256_of(new)) is True
    assert (target / "common.txt").read_text() == "new"
    assert (target / "only_new.txt").read_text() == "hello"
    assert not (target / "only_old").exists()
    assert read_marker(target)["archive_sha256"] == sha256_of(new)
    assert not staging_of(target).exists()

    assert extract(new, target, sha256_of(new)) is False


def test_refused_re_extraction_keeps_previous_content(src: Path, target: Path) -> None:
    good = make_zip(src / "good.zip", [_file("keep.txt", "kept")])
    bad = make_tar(src / "bad.tar", [_file("new.txt", "n"), _file("../evil.txt", "pwned")])
    assert extract(good, target, sha256_of(good)) is True
    with pytest.raises(UnsafeArchiveError):
        extract(bad, target, sha256_of(bad))
    assert (target / "keep.txt").read_text() == "kept"
    assert not (target / "new.txt").exists()
    assert read_marker(target)["archive_sha256"] == sha256_of(good)
    assert not staging_of(target).exists()


# --------------------------------------------------------------------------------------------------
# bad inputs
# --------------------------------------------------------------------------------------------------


def test_neither_zip_nor_tar_raises_value_error(tmp_path: Path, src: Path, target: Path) -> None:
    archive = src / "notes.txt"
    archive.write_text("just some text, not an archive\n" * 50)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match="neither a zip nor a tar") as excinfo:
        extract(archive, target, sha256_of(archive))
    assert not isinstance(excinfo.value, UnsafeArchiveError)
    assert snapshot(tmp_path) == before
    assert not staging_of(target).exists()


def test_missing_archive_raises_file_not_found(src: Path, target: Path) -> None:
    with pytest.raises(FileNotFoundError):
        extract(src / "missing.zip", target, "0" * 64)
    assert not target.exists()
    assert not staging_of(target).exists()


# --------------------------------------------------------------------------------------------------
# check_entry unit tests
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("./a/b", "a/b"),
        ("a/b", "a/b"),
        ("a/b/", "a/b"),
        ("./a/b/", "a/b"),
        ("a", "a"),
    ],
)
def test_check_entry_normalises(name: str, expected: str) -> None:
    assert check_entry(ArchiveEntry(name, "file")) == expected


def test_check_entry_normalises_dir_entries() -> None:
    assert check_entry(ArchiveEntry("./data/images/", "dir")) == "data/images"


@pytest.mark.parametrize(
    "name",
    [
        "a/../../b",  # '..' in the middle escaping
        "a/../b",  # any '..' component is refused, even one that would stay inside
        "../a",
        "a/..",
        "..",
        "a\\b",  # backslash
        "..\\evil.txt",  # Windows-style zip slip
        "a/b\\..\\..\\c",
        "/abs/path",
        "/",
        "",
        "./",
        "a/b\x00c",
    ],
)
def test_check_entry_refuses_unsafe_names(name: str) -> None:
    with pytest.raises(UnsafeArchiveError):
        check_entry(ArchiveEntry(name, "file"))


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("a/link", "../b.txt"),  # resolves to b.txt
        ("a/b/link", "../../c"),  # resolves to c
        ("link", "."),
        ("a/link", ".."),  # the root itself
        ("link", "a/./b"),
    ],
)
def test_check_entry_accepts_symlinks_inside(name: str, target: str) -> None:
    assert check_entry(ArchiveEntry(name, "symlink", target)) == name


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("link", ".."),
        ("link", "../x"),
        ("a/link", "../../x"),
        ("a/b/link", "../../../x"),
        ("link", "a/../../x"),
        ("link", "/etc/passwd"),
        ("link", "a\\..\\..\\x"),
        ("link", ""),
    ],
)
def test_check_entry_refuses_symlinks_outside(name: str, target: str) -> None:
    with pytest.raises(UnsafeArchiveError, match="points outside"):
        check_entry(ArchiveEntry(name, "symlink", target))


def test_check_entry_refuses_symlink_without_target() -> None:
    with pytest.raises(UnsafeArchiveError, match="points outside"):
        check_entry(ArchiveEntry("link", "symlink", None))


def test_check_entry_hardlink_target_is_relative_to_root() -> None:
    # From 'a/b/h', '../x' would be inside for a symlink, but hard-link targets are root-relative.
    assert check_entry(ArchiveEntry("a/b/h", "symlink", "../x")) == "a/b/h"
    with pytest.raises(UnsafeArchiveError, match="points outside"):
        check_entry(ArchiveEntry("a/b/h", "hardlink", "../x"))
    assert check_entry(ArchiveEntry("a/b/h", "hardlink", "a/x")) == "a/b/h"
    assert check_entry(ArchiveEntry("h", "hardlink", "./a/x")) == "h"


@pytest.mark.parametrize("kind", ["device or fifo", "chardev", "socket"])
def test_check_entry_refuses_other_kinds(kind: str) -> None:
    with pytest.raises(UnsafeArchiveError, match="only files, folders and links"):
        check_entry(ArchiveEntry("dev/thing", kind))


def test_unsafe_archive_error_is_a_value_error() -> None:
    assert issubclass(UnsafeArchiveError, ValueError)
