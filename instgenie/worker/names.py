"""Names shared by a worker's processes and its clients (no heavy imports: the API process
imports this without torch)."""

from __future__ import annotations

#: uid of a template's capture run inside a worker (the supervisor tracks captures separately
#: and never forwards their progress to clients)
CAPTURE_PREFIX = "template:"


def capture_uid(template_id: str) -> str:
    return CAPTURE_PREFIX + template_id


def shm_base(supervisor_pid: int) -> str:
    """The shm prefix of every segment a worker's processes create (tensorshm.process_prefix)."""
    return f"igw{supervisor_pid}"
