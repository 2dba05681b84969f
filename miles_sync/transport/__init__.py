"""Transports that move weights from trainers to rollout engines.

`group` builds the update process group (a torch.distributed group from its own TCP rendezvous, independent of any
default group) that the distributed path broadcasts over.
"""
