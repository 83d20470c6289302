"""The emulated Azure: tests import it from here (``from tests.azure import ArmEmulator``).

- ``arm.py``: Azure Resource Manager with the Microsoft.NetApp resource provider (volumes, pool changes,
  snapshots and their long-running operations, each request recorded as the RBAC action ARM checks), over
  TLS with a throwaway CA.
- ``entra.py``: the Entra ID endpoints its clients ask first (OpenID configuration, client-credentials
  token), which hand out ``TOKEN``.
"""

from tests.azure.arm import Arm, ArmEmulator
from tests.azure.entra import TOKEN

__all__ = ["TOKEN", "Arm", "ArmEmulator"]
