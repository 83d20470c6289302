"""What several unit test modules share: a dataset checksum and a data source whose URL carries a secret."""

from __future__ import annotations

from flows.params import DataSource

SHA = "a" * 64


def source() -> DataSource:
    return DataSource(url="https://mirror.example.org/train_set.zip?sig=secret", sha256=SHA)
