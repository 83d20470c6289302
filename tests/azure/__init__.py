"""The emulated Azure: tests import it from here (``from tests.azure import ArmEmulator``).

- ``arm.py``: Azure Resource Manager with the Microsoft.NetApp resource provider (volumes, pool changes,
  snapshots, their long-running operations) over TLS, and the Entra ID token endpoint its clients ask first.
"""

from tests.azure.arm import TOKEN, Arm, ArmEmulator

__all__ = ["TOKEN", "Arm", "ArmEmulator"]
