"""What this machine's CPU does natively, read from ``/proc/cpuinfo``: the facts behind ``precision: auto``.

bf16 is native where the CPU has bf16 instructions: Intel AMX (``amx_bf16``, Xeon since Sapphire Rapids),
AVX512-BF16 (``avx512_bf16``: AMD since Zen 4, Intel since Cooper Lake) or Arm's BF16 extension (``bf16`` in
an aarch64 ``Features`` line: Neoverse V1/N2, Graviton 3). Elsewhere oneDNN emulates bf16 with fp32
arithmetic plus conversions, which is slower than fp32 alone: such a CPU keeps fp32.

``LANEFLOW_CPUINFO=/path/to/cpuinfo`` makes laneflow read another machine's /proc/cpuinfo text instead of this
one's: what ``auto`` would choose on that CPU, tried anywhere without root (the test suite runs a trainer as a
Zen 3 this way). It changes what laneflow believes about the CPU, not the kernels PyTorch runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

#: The flags that say bf16 is native, by what /proc/cpuinfo calls them (x86 ``flags``, aarch64 ``Features``).
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
#: The flags that shape which kernels oneDNN picks: part of what identifies a machine to a cached calibration.
KERNEL_FLAGS = (*NATIVE_BF16_FLAGS, "amx_tile", "avx512f", "avx512_vnni", "avx2", "fma", "asimd", "sve")


@dataclass(frozen=True)
class CpuFeatures:
    """A CPU as laneflow's numeric choices see it."""

    model: str
    flags: frozenset[str]
    logical_cpus: int

    @property
    def native_bf16(self) -> tuple[str, ...]:
        """The native-bf16 flags this CPU has (empty: bf16 would be emulated)."""
        return tuple(flag for flag in NATIVE_BF16_FLAGS if flag in self.flags)

    def fingerprint(self) -> dict[str, object]:
        """What identifies this kind of machine to a calibration: the CPU model and its kernel-relevant flags."""
        return {"cpu": self.model, "flags": sorted(self.flags & set(KERNEL_FLAGS)), "logical_cpus": self.logical_cpus,
                "arch": platform.machine()}

    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.fingerprint(), sort_keys=True).encode()).hexdigest()[:16]


def parse_cpuinfo(text: str) -> CpuFeatures:
    """The first processor's model and flags from /proc/cpuinfo's text (x86 or aarch64), and how many there are."""
    model, flags, count = "", frozenset[str](), 0
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip().lower()
        if key == "processor":
            count += 1
        elif key in ("model name", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = frozenset(value.split())
    if not model and "CPU part" in text:  # aarch64 names no model: its implementer and part identify it
        parts = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if _}
        model = f"arm implementer {parts.get('CPU implementer', '?')} part {parts.get('CPU part', '?')}"
    return CpuFeatures(model or "unknown", flags, count)


#: Names a file read instead of /proc/cpuinfo (another machine's text): see the module's docstring.
CPUINFO_ENV = "LANEFLOW_CPUINFO"


def this_cpu(cpuinfo: Path | None = None) -> CpuFeatures:
    """This machine's CPU, from ``cpuinfo`` (default: ``$LANEFLOW_CPUINFO``, else /proc/cpuinfo). Without
    /proc/cpuinfo, as on macOS: unknown, no flags, so bf16 counts as emulated. A ``$LANEFLOW_CPUINFO`` that cannot be
    read is an error: the run would otherwise decide for a CPU it was not asked about."""
    override = os.environ.get(CPUINFO_ENV)
    if cpuinfo is None and override:
        try:
            return parse_cpuinfo(Path(override).read_text())
        except OSError as exc:
            raise ValueError(f"{CPUINFO_ENV}={override} cannot be read ({exc.strerror or exc}): point it at a file "
                             f"with a machine's /proc/cpuinfo text, or unset it to read this machine's") from exc
    try:
        return parse_cpuinfo((cpuinfo or Path("/proc/cpuinfo")).read_text())
    except OSError:
        return CpuFeatures(platform.processor() or "unknown", frozenset(), 0)
