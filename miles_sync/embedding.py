"""The embedding API: a Miles/slime-style pipeline with its own Ray actors syncs weights through miles_sync.

Three steps, none of which needs miles_sync's launch code:

1. On every trainer rank, once its Megatron model exists (inside the pipeline's own trainer actor):

       from miles_sync.embedding import attach_model
       attach_model(model, hf_config=hf_config)          # the one call; `model` is this rank's model (chunks)

   torch.distributed and megatron-core model parallelism must already be initialized (the pipeline's own).
2. On the driver, with the trainer actors' handles (in rank order) and the URLs of running SGLang-compatible
   servers:

       from actors import create_controller
       controller = create_controller(trainers=trainer_actors, engine_urls=urls, sync=SyncConfig(...),
                                      model=ModelConfig(speculative_algorithm=..., num_trained_mtp_layers=0))
3. After each optimizer step (trainers idle, between steps):

       report = ray.get(controller.sync.remote(), timeout=...)   # SyncReport; raises SyncError if it failed

Pipeline parallelism: every rank of every stage calls `attach_model` with its own stage's model (chunks), and the
driver passes all trainer actors, in rank order, to one controller. `connect()` reads each rank's pipeline stage and
finds each stage's export source (its tp 0 / dp 0 rank): one source per stage, each with an update group of its
own, opened in stage order, and every engine receives stage 0's buckets before stage 1's (so engines that, like
SGLang, handle one weight update at a time never wait in two stages' broadcasts at once). Stages after the first
pack their buckets while the earlier ones send. A pipeline with its own sources (not trainer actors) composes
them the same way with `miles_sync.sync.pipeline.PipelineSource([stage0, stage1, ...])`, a WeightSource the
`SyncController` takes as its source. With the colocated transport and pipeline stages, pass no feed plan: each
stage's source feeds every engine rank itself. `examples/embed_in_pipeline.py --pp 2` runs a two-stage pipeline.

The controller reaches each rank's attached model through Ray's `__ray_call__` on the given actors, so the
pipeline's actor classes need no extra methods; a rank's export runs in its own process, on a thread of its own,
while the actor is otherwise idle (a sync actor runs it like any call; an async actor's event loop waits for it).
This module only names the public calls; they live in `miles_sync.sync.attach`.
"""

from miles_sync.sync.attach import DEFAULT_ATTACHMENT, attach_model, attached_source, detach_model

__all__ = ["DEFAULT_ATTACHMENT", "attach_model", "attached_source", "detach_model"]
