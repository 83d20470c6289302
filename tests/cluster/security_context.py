"""Who a container's process runs as, from the pod's and the container's ``securityContext`` and the image's
``USER``, as the kubelet and the container runtime decide it.

- The effective settings: a container's ``runAsUser``, ``runAsGroup`` and ``runAsNonRoot`` override the pod's
  (k8s.io/kubernetes pkg/securitycontext ``DetermineEffectiveSecurityContext``).
- ``runAsNonRoot`` is checked before the container is created, with the kubelet's messages
  (pkg/kubelet/kuberuntime/security_context_others.go ``verifyRunAsNonRoot``); an image without ``USER`` runs
  as uid 0 (kuberuntime ``getImageUser``). A refusal is a CreateContainerConfigError.
- The user and groups are resolved inside the container's file system, as runc does
  (libcontainer/user ``GetExecUserPath``): a user name through its ``/etc/passwd``; without ``runAsGroup`` the
  group is the image user's, else the passwd entry's, else 0; the additional groups are the user's in its
  ``/etc/group``, the pod's ``supplementalGroups`` and ``fsGroup`` (containerd ``WithAdditionalGIDs``, CRI
  ``WithSupplementalGroups``); ``HOME`` comes from the passwd entry when the environment has none ("/" for a
  uid it lacks: libcontainer ``setupUser``). That part runs in ``podinit.py``, after ``chroot``.

- Capabilities: containerd's default set for a container (containerd ``pkg/oci/spec.go``
  ``populateDefaultUnixSpec``: CHOWN, DAC_OVERRIDE, FSETID, FOWNER, MKNOD, NET_RAW, SETGID, SETUID, SETFCAP, SETPCAP,
  NET_BIND_SERVICE, SYS_CHROOT, KILL, AUDIT_WRITE), with the container's ``capabilities.add`` and ``drop`` (``ALL``
  drops every one; names without the ``CAP_`` prefix, as the kubelet passes them); ``podinit.py`` drops the rest
  from the bounding set before the container's command runs, so a root process in it has only these (no
  SYS_PTRACE: it cannot read another user's ``/proc/<pid>/environ``; no SYS_ADMIN: it cannot mount).

Not enforced here: ``allowPrivilegeEscalation`` (no_new_privs) and seccomp. The kernel enforces the uid, gid and
capabilities themselves, so a container really cannot do what its user and capabilities do not allow.
"""

from __future__ import annotations

from typing import Any

_USER_FIELDS = ("runAsUser", "runAsGroup", "runAsNonRoot")
DEFAULT_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID",
                        "SETFCAP", "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE")


def effective(pod: dict, container: dict) -> dict[str, Any]:
    """The user fields that apply to ``container``: its own, else the pod's."""
    pod_context = pod["spec"].get("securityContext") or {}
    container_context = container.get("securityContext") or {}
    return {field: container_context.get(field, pod_context.get(field)) for field in _USER_FIELDS}


def image_uid(image_user: str) -> int | None:
    """The uid an image's ``USER`` names when it is numeric ("1000", "1000:0"), 0 when it sets none, None for a
    user name (only resolvable inside the container)."""
    user = image_user.split(":", 1)[0]
    if not user:
        return 0
    return int(user) if user.isdigit() else None


def verify_run_as_non_root(pod: dict, container: dict, image_user: str) -> None:
    """ValueError with the kubelet's message when ``runAsNonRoot`` forbids what the container would run as."""
    context = effective(pod, container)
    if not context["runAsNonRoot"]:
        return
    where = f'(pod: "{pod["metadata"]["name"]}_{pod["metadata"]["namespace"]}({pod["metadata"].get("uid", "")})", ' \
            f'container: {container["name"]})'
    if context["runAsUser"] is not None:
        if int(context["runAsUser"]) == 0:
            raise ValueError(f"container's runAsUser breaks non-root policy {where}")
        return
    uid = image_uid(image_user)
    if uid == 0:
        raise ValueError(f"container has runAsNonRoot and image will run as root {where}")
    if uid is None:
        raise ValueError(f"container has runAsNonRoot and image has non-numeric user "
                         f"({image_user.split(':', 1)[0]}), cannot verify user is non-root {where}")


def process_user(pod: dict, container: dict, image_user: str) -> dict[str, Any]:
    """What ``podinit.py`` needs to switch to the container's user after ``chroot``: ``user`` (a uid, or a name
    to look up), ``group`` (a gid, a name, or None: the passwd entry's), ``supplemental`` gids."""
    context = effective(pod, container)
    pod_context = pod["spec"].get("securityContext") or {}
    user_part, _, group_part = image_user.partition(":")
    user: int | str = int(context["runAsUser"]) if context["runAsUser"] is not None else (
        int(user_part) if user_part.isdigit() else user_part or 0)
    group: int | str | None
    if context["runAsGroup"] is not None:
        group = int(context["runAsGroup"])
    elif context["runAsUser"] is None and group_part:
        group = int(group_part) if group_part.isdigit() else group_part
    else:
        group = None
    supplemental = [int(gid) for gid in pod_context.get("supplementalGroups") or []]
    if pod_context.get("fsGroup") is not None:
        supplemental.append(int(pod_context["fsGroup"]))
    return {"user": user, "group": group, "supplemental": supplemental}


def capabilities(container: dict) -> list[str]:
    """The capabilities the container's processes keep: the runtime's defaults, then ``add``, less ``drop``."""
    wanted = (container.get("securityContext") or {}).get("capabilities") or {}
    drop = {name.upper().removeprefix("CAP_") for name in wanted.get("drop") or []}
    add = [name.upper().removeprefix("CAP_") for name in wanted.get("add") or []]
    kept = [] if "ALL" in drop else [name for name in DEFAULT_CAPABILITIES if name not in drop]
    return sorted({*kept, *(name for name in add if name != "ALL" and name not in drop)})
