"""kvsidecar behind vLLM: the KV connector's two sides and what they share.

``transport.vllm_connector.KVSidecarConnector`` is the class vLLM loads; it hands each
call to the side it runs on: ``scheduler.SchedulerSide`` in the engine-core process
(lookups, load and save plans, when blocks may be freed), ``worker.WorkerSide`` in each
worker (vLLM's KV tensors shared in place, loads and saves issued, completions reported).
``layout`` converts vLLM's ``KVCacheConfig`` into a kvsidecar layout; ``plan`` holds the
metadata the scheduler sends the workers each step.
"""
