"""
Error codes of model delivery (C{command_result.error_code}, <= 128 chars).

C{invalid_command} (from L{llmport_agent.commands.base}) is used for a malformed manifest.
"""

from __future__ import annotations

#: Not enough free disk under MODEL_STORE for what is still missing (result carries the numbers).
INSUFFICIENT_DISK = "insufficient_disk"
#: The backend answered 401/403 to the node credential: re-enroll the node.
CREDENTIAL_REJECTED = "credential_rejected"
#: A blob or the manifest could not be fetched (404, other 4xx, or retries exhausted).
DOWNLOAD_FAILED = "download_failed"
#: A downloaded blob's size or sha256 does not match its name in the manifest.
CHECKSUM_MISMATCH = "checksum_mismatch"
#: The model store could not be written (permissions, I/O error).
STORAGE_ERROR = "storage_error"
#: The manifest's chosen revision has no C{snapshots/<commit>} directory in the store.
SNAPSHOT_MISSING = "snapshot_missing"
