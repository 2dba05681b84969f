"""Transports that move weights from trainers to rollout engines.

`group` builds the update process group (a torch.distributed group from its own TCP rendezvous, independent of any
default group) that the distributed path broadcasts over.
"""

from miles_sync.transport.group import UpdateGroup, create_update_group, start_store_server

__all__ = ["UpdateGroup", "create_update_group", "start_store_server"]
